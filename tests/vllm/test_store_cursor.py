"""kvhal's scheduler side (`SchedulerSide`, real manager and host region) placing stores when
the host tier has fewer free slots than a step's due chunks: what does not fit stays due and
is stored in a later step, in order (no gap in a stored prefix); what a request never got a
slot for before it finished is counted as skipped; a request vLLM computes in full (prompt
logprobs) is not looked up.

vLLM is stood in for by its scheduler's outputs (`step`) and a block table (`Blocks`); every
block id, chunk and count below is exact. Each test was seen failing with `StorePlanner.plan`'s
cursor set to the end of the due chunks before placing them (the old code).
"""
from __future__ import annotations

import hashlib
import logging
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="the scheduler side imports vLLM (the `vllm` extra)")

from kvhal.config import parse_config  # noqa: E402
from kvhal.integrations.vllm.geometry import Deployment, GroupInfo  # noqa: E402
from kvhal.integrations.vllm.metadata import KVHalWorkerMetadata  # noqa: E402
from kvhal.integrations.vllm.scheduler import SchedulerSide  # noqa: E402
from kvhal.keys import ChunkKey  # noqa: E402
from kvhal.layout import attention_spec, chunk_layout  # noqa: E402

from ..tiers.helpers import NAMESPACE  # noqa: E402

BLOCK = 64
CHUNKS = 4                       # full chunks of every prompt (1 block per chunk)
PROMPT = CHUNKS * BLOCK + 1
#: Canonical bytes of one 64-token block of 2 fp16 layers of 2 KV heads of 64: 64 KiB.
CHUNK = 2 * 2 * BLOCK * 2 * 64 * 2


def _side(slots: int, groups: int = 1) -> SchedulerSide:
    spec = attention_spec(num_layers=2, num_kv_heads=2, head_size=64, dtype="fp16",
                          block_size=BLOCK)
    infos = tuple(GroupInfo(g, spec, (f"layer.{g}.0", f"layer.{g}.1"),
                            chunk_layout(spec, 1).chunk_bytes) for g in range(groups))
    # vLLM's default sha256 seed, as `get_none_hash_seed` reports it: the hash check passes
    dep = Deployment(infos, BLOCK, 1, 1, "fp16", "sha256", "vllm-none-hash", "LBHNC")
    side = SchedulerSide(dep, parse_config({"cpu_bytes_to_use": slots * CHUNK}),
                         f"test-store-cursor-{slots}-{groups}", NAMESPACE)
    side.kv_cache_manager = Blocks(groups)
    return side


class Blocks:
    """vLLM's block table: request r's blocks are 100 * (its number) + chunk, per group
    (+ 1000 * group)."""

    def __init__(self, groups: int):
        self.groups = groups

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        base = 100 * int(req_id[1:])
        return tuple([1000 * g + base + c for c in range(CHUNKS + 1)]
                     for g in range(self.groups))


def _request(side: SchedulerSide, n: int, **extra) -> SimpleNamespace:
    """Request "r<n>": a PROMPT-token prompt of its own, asked about by vLLM."""
    request = SimpleNamespace(
        request_id=f"r{n}", num_tokens=PROMPT, num_prompt_tokens=PROMPT,
        num_computed_tokens=0, kv_transfer_params=None, skip_reading_prefix_cache=False,
        block_hashes=[hashlib.sha256(f"{n}-{i}".encode()).digest() for i in range(CHUNKS)])
    request.__dict__.update(extra)
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)
    return request


def step(side: SchedulerSide, new: list, cached: list = ()) -> dict:
    """One scheduler step: the prompts of `new` computed whole, one token of each of
    `cached`; returns this step's store jobs as {(request id, group): [chunks, block ids]}."""
    out = SimpleNamespace(
        num_scheduled_tokens={r.request_id: PROMPT for r in new}
        | {r.request_id: 1 for r in cached},
        scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, num_computed_tokens=0)
                            for r in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r.request_id for r in cached],
            num_computed_tokens=[r.num_computed_tokens for r in cached],
            new_block_ids=[None for _ in cached]),
        preempted_req_ids=set(), total_num_scheduled_tokens=1, kv_connector_block_state=None)
    meta = side.build_connector_meta(out)
    for r in new:
        r.num_computed_tokens = PROMPT
    for r in cached:
        r.num_computed_tokens += 1
    return {(job.req_id, job.group): [side.jobs[job.job_id].chunks.tolist(),
                                      job.block_ids.ravel().tolist()]
            for job in meta.stores} | {"ids": [job.job_id for job in meta.stores]}


def finish(side: SchedulerSide, job_ids: list[int]) -> None:
    """The workers stored every chunk of these jobs."""
    side.update_connector_output(KVHalWorkerMetadata(
        ranks_done={j: 1 for j in job_ids},
        num_ok={j: side.jobs[j].num_chunks for j in job_ids}))


def test_chunks_that_found_no_slot_are_stored_in_order_in_a_later_step():
    """6 slots, two 4-chunk prompts in one step: r1 gets 4 slots, r2 2 (chunks 0-1). Once
    those stores finished, r2's next step stores chunks 2-3 (the old cursor had passed them:
    nothing more was ever due)."""
    side = _side(slots=6)
    try:
        r1, r2 = _request(side, 1), _request(side, 2)
        first = step(side, [r1, r2])
        assert first == {("r1", 0): [[0, 1, 2, 3], [100, 101, 102, 103]],
                         ("r2", 0): [[0, 1], [200, 201]], "ids": first["ids"]}
        finish(side, first["ids"])
        second = step(side, [], [r1, r2])
        assert second == {("r2", 0): [[2, 3], [202, 203]], "ids": second["ids"]}
        finish(side, second["ids"])
        assert (side.counters.totals["store_chunks"], side.counters.totals["store_skipped_chunks"]) == (8, 0)
    finally:
        side.close()


def test_the_cursor_stops_at_the_first_chunk_any_group_could_not_place():
    """Two KV cache groups of 4 slots each; group 1 has 2 slots taken by another store: r1's
    step places chunks 0-3 of group 0 and 0-1 of group 1. The next step stores group 1's
    chunks 2-3 only (group 0 holds its own)."""
    side = _side(slots=8, groups=2)
    try:
        other = side.manager.prepare_store([ChunkKey(NAMESPACE, 1, bytes([i]) * 32)
                                            for i in range(2)])
        r1 = _request(side, 1)
        first = step(side, [r1])
        assert first == {("r1", 0): [[0, 1, 2, 3], [100, 101, 102, 103]],
                         ("r1", 1): [[0, 1], [1100, 1101]], "ids": first["ids"]}
        side.manager.complete_store(other.job_id, 0)
        second = step(side, [], [r1])
        assert second == {("r1", 1): [[2, 3], [1102, 1103]], "ids": second["ids"]}
    finally:
        side.close()


def test_request_finished_stores_what_is_still_due_in_the_next_step():
    """r2 finishes right after the step that left its chunks 2-3 unplaced: vLLM keeps its
    blocks (delay_free) and the next step stores them."""
    side = _side(slots=6)
    try:
        r1, r2 = _request(side, 1), _request(side, 2)
        finish(side, step(side, [r1, r2])["ids"])
        delay_free, _ = side.request_finished(r2)
        after = step(side, [])
        assert delay_free is True
        assert after == {("r2", 0): [[2, 3], [202, 203]], "ids": after["ids"]}
        assert side.counters.totals["store_skipped_chunks"] == 0
    finally:
        side.close()


def test_what_never_found_a_slot_before_the_request_finished_is_counted_once(caplog):
    """4 slots, all still being written for r1 when r2 (which got none) finishes: its 4
    chunks are skipped: the connector's counter (and its group's), the engine's
    `skipped_chunks` metric, and one warning naming cpu_bytes_to_use; r3, skipped within the
    warning interval, is counted without another warning."""
    side = _side(slots=4)
    try:
        r1, r2, r3 = (_request(side, n) for n in (1, 2, 3))
        first = step(side, [r1, r2, r3])
        assert list(first) == [("r1", 0), "ids"]
        side.manager.metrics.take_delta()
        with caplog.at_level(logging.WARNING, logger="kvhal.engine.manager"):
            assert side.request_finished(r2)[0] is False
            assert side.request_finished(r3)[0] is False
        assert side.counters.totals["store_skipped_chunks"] == 2 * CHUNKS
        assert side.counters.by_group["store_skipped_chunks"] == [2 * CHUNKS]
        assert side.manager.metrics.take_delta()["counters"]["skipped_chunks"] == {
            "host": 2 * CHUNKS}
        (warning,) = [r.getMessage() for r in caplog.records]
        assert warning == ("kvhal: 4 chunks due for storing found no free host slot before "
                           "their request ended and were not stored: the host tier (4 slots, "
                           "cpu_bytes_to_use) is smaller than one step's stores")
        assert step(side, []) == {"ids": []}
    finally:
        side.close()


def test_a_request_vllm_computes_in_full_is_not_looked_up():
    """r2 has r1's prompt, whose 4 chunks are in the host tier, and asks for prompt logprobs
    (vLLM sets `skip_reading_prefix_cache`): no hit, nothing looked up or pinned; its chunks
    are still due for storing (held already: no job)."""
    side = _side(slots=8)
    try:
        r1 = _request(side, 1)
        finish(side, step(side, [r1])["ids"])
        side.request_finished(r1)
        side.manager.metrics.take_delta()
        r2 = SimpleNamespace(**{**vars(r1), "request_id": "r2", "num_computed_tokens": 0,
                                "skip_reading_prefix_cache": True})
        assert side.get_num_new_matched_tokens(r2, 0) == (0, False)
        assert "chunk_lookups" not in side.manager.metrics.take_delta().get("counters", {})
        assert side.manager.stats()["lookup_pins"] == 0
        assert step(side, [r2]) == {"ids": []}
        assert side.requests.get("r2").num_stored_chunks == CHUNKS
    finally:
        side.close()


def test_chunks_stored_behind_one_still_being_promoted_are_not_counted_skipped():
    """Chunk 1 of r1's prefix is being promoted into host memory for another request when
    r1 computes it: r1 stores chunks 0, 2 and 3, its cursor stays at chunk 1 (the promotion
    may fail), and when r1 finishes before that promotion ends only chunk 1 counts as
    skipped, not the chunks placed behind it. Seen failing with every chunk after the first
    not held counted: 3 skipped."""
    side = _side(slots=8)
    try:
        r1 = _request(side, 1)
        key = side.requests.keys(r1, 0)[1]
        (slot,), _ = side.manager.slots.reserve([key], frozenset())
        side.manager._promo[slot] = "another request"      # its promotion is in flight
        first = step(side, [r1])
        assert first == {("r1", 0): [[0, 2, 3], [100, 102, 103]], "ids": first["ids"]}
        side.request_finished(r1)
        assert side.counters.totals["store_skipped_chunks"] == 1
    finally:
        side.close()
