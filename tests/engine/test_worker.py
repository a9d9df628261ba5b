"""Worker: stores wait for the compute, the compute waits for loads, failed sub-transfers fail
the rest, fenced blocks."""
from __future__ import annotations

import numpy as np
import pytest

from kvhal.backends.cpu import CpuBackend
from kvhal.engine import BlockPlanner, Direction, EngineError
from kvhal.hal import host_array
from kvhal.layout.plan import merge_plans
from kvhal.tier import Lookup

from .rig import FaultyLateStreams, chunk_blocks, make_rig, synthetic_keys

HIT, MISS, RETRY = Lookup.HIT, Lookup.MISS, Lookup.RETRY
CHUNK_BLOCKS, BLOCK_BYTES = 2, 2048
CHUNK_BYTES = CHUNK_BLOCKS * BLOCK_BYTES


def _delayed_compute_round_trips(seed: int, runs: int, wait: bool) -> int:
    """Each run: a chaos-delayed "compute" writes a chunk's blocks, the store is issued right
    after it (waiting on its event or not), then the chunk is loaded elsewhere and compared.
    Returns the number of runs whose reloaded bytes differ from what the compute wrote."""
    rig = make_rig(capacity=4, blocks_per_chunk=CHUNK_BLOCKS, block_bytes=BLOCK_BYTES,
                   num_blocks=8, chaos_seed=seed)
    backend = rig.backend
    compute, event = backend.create_stream(), backend.create_event()
    src = backend.alloc_pinned(runs * CHUNK_BYTES)
    data = host_array(src)
    data[:] = np.random.default_rng(seed).integers(0, 256, data.size, dtype=np.uint8)
    keys = synthetic_keys(runs, tag=seed)
    wrong = 0
    try:
        for i in range(runs):
            backend.copy_async(rig.worker.planner.device_base, src.ptr + i * CHUNK_BYTES,
                               CHUNK_BYTES, compute)
            backend.record_event(event, compute)
            rig.store([keys[i]], chunk_blocks(0, 1, CHUNK_BLOCKS), after=event if wait else None)
            backend.stream_synchronize(compute)
            assert rig.load([keys[i]], chunk_blocks(2, 1, CHUNK_BLOCKS)).num_ok == 1
            wrong += not np.array_equal(rig.dev[2:4].ravel(),
                                        data[i * CHUNK_BYTES:(i + 1) * CHUNK_BYTES])
    finally:
        backend.destroy_stream(compute)
        backend.free(src)
        rig.close()
    return wrong


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_store_after_delayed_compute_restores_identical_bytes(seed):
    """1,000 seeded runs in all (4 seeds × 250)."""
    assert _delayed_compute_round_trips(seed, runs=250, wait=True) == 0


def test_without_the_compute_event_the_store_copies_stale_bytes():
    """The test above can fail: drop the event wait and chaos mode exposes it."""
    assert _delayed_compute_round_trips(5, runs=200, wait=False) > 0


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_a_reader_after_stream_wait_job_sees_the_late_load(seed):
    """A read queued on a "compute" stream after `stream_wait_job` gets the loaded bytes,
    though the load's copies start 50 ms late; the job still ends exactly once.

    Shown to fail: with the stream wait removed from `stream_wait_job`, 4/4 seeds read the
    stale 0xFF bytes."""
    compute: list = []
    backend = FaultyLateStreams(lambda s: s.handle is not compute[0].handle, chaos_seed=seed)
    compute.append(backend.create_stream())
    rig = make_rig(capacity=4, blocks_per_chunk=CHUNK_BLOCKS, block_bytes=BLOCK_BYTES,
                   num_blocks=8, backend=backend)
    out = backend.alloc_pinned(CHUNK_BYTES)
    try:
        data = _blocks_data(rig, 0, 2)
        key = synthetic_keys(1, tag=seed)
        assert rig.store(key, chunk_blocks(0, 1, CHUNK_BLOCKS)).num_ok == 1
        rig.dev[2:4] = 0xFF
        plan = rig.manager.prepare_load(key)
        rig.worker.submit_load(plan.job_id, chunk_blocks(2, 1, CHUNK_BLOCKS), plan.slots)
        rig.worker.stream_wait_job(compute[0], plan.job_id)
        backend.copy_async(out.ptr, rig.worker.planner.device_base + 2 * BLOCK_BYTES,
                           CHUNK_BYTES, compute[0])
        backend.stream_synchronize(compute[0])
        assert np.array_equal(host_array(out), data[0:2].ravel())
        assert rig.finish(plan.job_id).num_ok == 1
        assert rig.worker.get_finished() == []
    finally:
        backend.free(out)
        backend.destroy_stream(compute[0])
        rig.close()


class FaultyPlanner:
    """Plans like `inner` but points the job's block `bad_block` at an unmapped address, so
    the backend refuses that chunk's copy when it is issued."""

    def __init__(self, inner, bad_block: int):
        self.inner, self.bad_block, self.seen = inner, bad_block, 0
        self.device_base = inner.device_base

    def __call__(self, block_ids, slot_addr, direction):
        plan = self.inner(block_ids, slot_addr, direction)
        first, self.seen = self.seen, self.seen + len(block_ids)
        if first <= self.bad_block < self.seen:
            side = plan.srcs if direction is Direction.D2H else plan.dsts
            side[self.bad_block - first] = 8
        return plan


class FaultyBackend(CpuBackend):
    """A cpu backend on which batched copies touching device address `bad_addr` fault on the
    stream (the error surfaces at the next event, like a device fault on bad memory); the first
    `faults` such batches fault (None: all)."""

    def __init__(self, faults: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.bad_addr, self.faults = None, faults

    def copy_batch_async(self, dsts, srcs, sizes, stream):
        super().copy_batch_async(dsts, srcs, sizes, stream)
        if self.bad_addr is not None and self.faults != 0 and self.bad_addr in set(
                np.concatenate([dsts, srcs]).tolist()):
            self.faults = None if self.faults is None else self.faults - 1
            def fault():
                raise OSError(f"injected device fault at {self.bad_addr:#x}")
            self._worker(stream).submit(fault)


NUM_CHUNKS = 8


def _faulty_rig(mode: str, bad_block: int, first_block: int):
    """A rig where copying the job's `bad_block`-th block fails: refused when issued
    ("issue", counting planned blocks from `first_block`) or faulting on the device ("device",
    at device block `first_block + bad_block`)."""
    backend = FaultyBackend(chaos_seed=bad_block)
    rig = make_rig(capacity=16, blocks_per_chunk=CHUNK_BLOCKS, block_bytes=BLOCK_BYTES,
                   num_blocks=64, backend=backend)
    if mode == "issue":
        offset = 0 if first_block == 0 else NUM_CHUNKS * CHUNK_BLOCKS  # a load follows a store
        rig.worker.planner = FaultyPlanner(rig.worker.planner, bad_block + offset)
    else:
        backend.bad_addr = rig.worker.planner.device_base + (first_block + bad_block) * BLOCK_BYTES
    return rig


def _failure_cases(test):
    """Inject at block 0, 5 or 15 of 16 (2 blocks per chunk), refused at issue or faulting."""
    test = pytest.mark.parametrize("bad_block,num_ok", [(0, 0), (5, 2), (15, 7)])(test)
    return pytest.mark.parametrize("mode", ["issue", "device"])(test)


def _blocks_data(rig, first, n_chunks):
    rig.dev[first:first + n_chunks * CHUNK_BLOCKS] = np.random.default_rng(first).integers(
        0, 256, (n_chunks * CHUNK_BLOCKS, BLOCK_BYTES), dtype=np.uint8)
    return rig.dev[first:first + n_chunks * CHUNK_BLOCKS].copy()


@_failure_cases
def test_failed_store_sub_transfer_fails_its_chunk_and_the_rest(mode, bad_block, num_ok):
    rig = _faulty_rig(mode, bad_block, first_block=0)
    try:
        keys = synthetic_keys(NUM_CHUNKS)
        want = _blocks_data(rig, 0, NUM_CHUNKS)
        result = rig.store(keys, chunk_blocks(0, NUM_CHUNKS, CHUNK_BLOCKS))
        assert (result.num_ok, result.ok) == (num_ok, False)
        assert result.error.startswith(f"chunk {num_ok}:")
        assert rig.manager.lookup(keys) == [HIT] * num_ok + [MISS] * (NUM_CHUNKS - num_ok)
        assert rig.manager.stats()["free_slots"] == 16 - num_ok
        rig.dev[:] = 0
        if num_ok:
            assert rig.load(keys, chunk_blocks(32, num_ok, CHUNK_BLOCKS)).num_ok == num_ok
        assert np.array_equal(rig.dev[32:32 + num_ok * CHUNK_BLOCKS], want[:num_ok * CHUNK_BLOCKS])
        again = synthetic_keys(2, tag=9)                       # the stream works afterwards
        assert rig.store(again, chunk_blocks(40, 2, CHUNK_BLOCKS)).num_ok == 2
    finally:
        rig.close()


@_failure_cases
def test_failed_load_sub_transfer_never_counts_as_loaded(mode, bad_block, num_ok):
    rig = _faulty_rig(mode, bad_block, first_block=32)
    try:
        keys = synthetic_keys(NUM_CHUNKS)
        want = _blocks_data(rig, 0, NUM_CHUNKS)
        assert rig.store(keys, chunk_blocks(0, NUM_CHUNKS, CHUNK_BLOCKS)).num_ok == NUM_CHUNKS
        result = rig.load(keys, chunk_blocks(32, NUM_CHUNKS, CHUNK_BLOCKS))
        assert (result.num_ok, result.ok, result.direction) == (num_ok, False, Direction.H2D)
        assert result.error.startswith(f"chunk {num_ok}:")
        assert np.array_equal(rig.dev[32:32 + num_ok * CHUNK_BLOCKS], want[:num_ok * CHUNK_BLOCKS])
        assert rig.manager.stats()["reading_slots"] == 0
        assert rig.manager.lookup(keys) == [HIT] * NUM_CHUNKS      # host copies are intact
    finally:
        rig.close()


def test_transient_device_fault_is_replayed_and_loses_nothing():
    backend = FaultyBackend(faults=1, chaos_seed=1)
    rig = make_rig(capacity=16, blocks_per_chunk=CHUNK_BLOCKS, block_bytes=BLOCK_BYTES,
                   num_blocks=64, backend=backend)
    try:
        backend.bad_addr = rig.worker.planner.device_base + 5 * BLOCK_BYTES
        keys = synthetic_keys(NUM_CHUNKS)
        want = _blocks_data(rig, 0, NUM_CHUNKS)
        result = rig.store(keys, chunk_blocks(0, NUM_CHUNKS, CHUNK_BLOCKS))
        assert (result.num_ok, result.error, backend.faults) == (NUM_CHUNKS, None, 0)
        assert rig.load(keys, chunk_blocks(32, NUM_CHUNKS, CHUNK_BLOCKS)).num_ok == NUM_CHUNKS
        assert np.array_equal(rig.dev[32:32 + NUM_CHUNKS * CHUNK_BLOCKS], want)
    finally:
        rig.close()


@pytest.mark.parametrize("seed", range(20))
def test_preempted_request_blocks_stay_fenced_until_its_store_finishes(seed):
    rig = make_rig(capacity=8, blocks_per_chunk=CHUNK_BLOCKS, block_bytes=BLOCK_BYTES,
                   num_blocks=16, chaos_seed=seed)
    backend = rig.backend
    compute, event = backend.create_stream(), backend.create_event()
    try:
        keys = synthetic_keys(2)
        want = _blocks_data(rig, 8, 2)
        backend.copy_async(rig.worker.planner.device_base, rig.worker.planner.device_base
                           + 8 * BLOCK_BYTES, 4 * BLOCK_BYTES, compute)   # compute blocks 0-3
        backend.record_event(event, compute)
        plan = rig.manager.prepare_store(keys)
        rig.worker.submit_store(plan.job_id, chunk_blocks(0, 2, CHUNK_BLOCKS), plan.slots,
                                after=event)
        assert rig.worker.fenced_blocks().tolist() == [0, 1, 2, 3]
        rig.worker.wait_blocks([3])                   # preempted: wait before reusing blocks
        rig.dev[0:4] = 0xEE                           # another request overwrites them
        assert rig.manager.lookup(keys, pin_owner="r") == [RETRY, RETRY]  # re-admitted early
        (result,) = rig.worker.get_finished()
        rig.manager.complete_store(result.job_id, result.num_ok)
        assert rig.worker.fenced_blocks().tolist() == []
        assert rig.manager.lookup(keys, pin_owner="r") == [HIT, HIT]
        assert rig.load(keys, chunk_blocks(4, 2, CHUNK_BLOCKS), pin_owner="r").num_ok == 2
        assert np.array_equal(rig.dev[4:8], want[:4])
    finally:
        backend.destroy_stream(compute)
        rig.close()


def test_cancelled_store_keeps_blocks_fenced_then_ends_failed_once():
    rig = make_rig(capacity=8, blocks_per_chunk=CHUNK_BLOCKS, block_bytes=BLOCK_BYTES,
                   num_blocks=16, chaos_seed=3)
    try:
        keys = synthetic_keys(2)
        plan = rig.manager.prepare_store(keys)
        rig.worker.submit_store(plan.job_id, chunk_blocks(0, 2, CHUNK_BLOCKS), plan.slots)
        rig.worker.cancel(plan.job_id)
        assert rig.worker.fenced_blocks().tolist() == [0, 1, 2, 3]
        rig.worker.wait_blocks(np.array([0]))
        (result,) = rig.worker.get_finished()
        assert (result.job_id, result.num_ok, result.error) == (plan.job_id, 0, "cancelled")
        assert rig.worker.get_finished() == []
        rig.manager.complete_store(result.job_id, result.num_ok)
        assert rig.manager.lookup(keys) == [MISS, MISS]
        assert rig.manager.stats()["free_slots"] == 8
    finally:
        rig.close()


def test_bad_shapes_and_duplicate_jobs_are_refused():
    rig = make_rig(capacity=2, blocks_per_chunk=CHUNK_BLOCKS, block_bytes=BLOCK_BYTES,
                   num_blocks=8)
    try:
        with pytest.raises(EngineError, match=r"block_ids must be \(n, blocks_per_chunk\)"):
            rig.worker.submit_store(1, np.arange(4), np.array([0, 1]))
        rig.worker.submit_store(1, chunk_blocks(0, 1, CHUNK_BLOCKS), np.array([0]))
        with pytest.raises(EngineError, match="job 1 is already in flight"):
            rig.worker.submit_load(1, chunk_blocks(0, 1, CHUNK_BLOCKS), np.array([0]))
        rig.worker.wait()
    finally:
        rig.close()


def test_every_job_ends_exactly_once_under_faults_cancels_and_waits():
    """300 random jobs (stores and loads, some touching a faulty block, some cancelled),
    collected by a mix of polling, waiting on blocks and waiting on jobs."""
    backend = FaultyBackend(faults=None, chaos_seed=8)
    rig = make_rig(capacity=8, blocks_per_chunk=CHUNK_BLOCKS, block_bytes=256, num_blocks=64,
                   backend=backend)
    backend.bad_addr = rig.worker.planner.device_base + 63 * 256
    rng = np.random.default_rng(8)
    seen: list = []
    want: dict[int, int] = {}                       # job id -> expected num_ok
    try:
        for job_id in range(300):
            n = int(rng.integers(1, 5))
            blocks = rng.choice(64, size=(n, CHUNK_BLOCKS), replace=False)
            slots = rng.integers(0, 8, n)
            submit = rig.worker.submit_store if rng.random() < 0.5 else rig.worker.submit_load
            submit(job_id, blocks, slots)
            faulty = np.flatnonzero((blocks == 63).any(axis=1))
            want[job_id] = int(faulty[0]) if faulty.size else n
            if rng.random() < 0.1:
                rig.worker.cancel(job_id)
                want[job_id] = 0
            action = rng.integers(4)
            if action == 1:
                rig.worker.wait_blocks(blocks[0])
            elif action == 2:
                rig.worker.wait(job_id)
            seen += rig.worker.get_finished()
        rig.worker.wait()
        seen += rig.worker.get_finished()
        assert sorted(r.job_id for r in seen) == list(range(300))
        assert {r.job_id: r.num_ok for r in seen} == want
        assert rig.worker.fenced_blocks().size == 0
    finally:
        rig.close()


def test_block_planner_plans_a_job_as_its_chunks_merged():
    planner = BlockPlanner(device_base=1 << 20, block_bytes=256, num_blocks=10, block_stride=512)
    ids, addrs = np.array([[3, 1], [0, 9]]), np.array([8000, 4000])
    job = planner.plan_job(ids, addrs, Direction.D2H)
    assert job.dsts.tolist() == [8000, 8256, 4000, 4256]
    assert job.srcs.tolist() == [(1 << 20) + 512 * b for b in (3, 1, 0, 9)]
    assert job.sizes.tolist() == [256] * 4 and job.copies_2d.shape == (0, 6)
    for direction in Direction:
        merged = merge_plans([planner(ids[c], int(addrs[c]), direction) for c in range(2)])
        job = planner.plan_job(ids, addrs, direction)
        assert [a.tolist() for a in (job.dsts, job.srcs, job.sizes)] == \
            [a.tolist() for a in (merged.dsts, merged.srcs, merged.sizes)]
    with pytest.raises(ValueError, match=r"block ids \[10, -1\] outside \[0, 10\)"):
        planner.plan_job(np.array([[1, 10], [-1, 2]]), addrs, Direction.H2D)


def test_a_chunk_the_job_planner_refuses_ends_the_job_there():
    """plan_job refuses the job (chunk 2 has a block id out of range): the worker plans chunk
    by chunk, moves chunks 0 and 1 and reports chunk 2 as the failure."""
    rig = make_rig(capacity=4, blocks_per_chunk=CHUNK_BLOCKS, block_bytes=BLOCK_BYTES,
                   num_blocks=8)
    try:
        data = _blocks_data(rig, 0, 2)
        ids = np.array([[0, 1], [2, 3], [4, 99], [6, 7]])
        rig.worker.submit_store(1, ids, np.array([3, 2, 1, 0]))
        rig.worker.wait(1)
        (result,) = rig.worker.get_finished()
        assert (result.num_ok, result.num_chunks) == (2, 4)
        assert result.error.startswith("chunk 2: block ids [99] outside [0, 8)")
        slots = rig.region.array.reshape(4, -1)[:, :CHUNK_BYTES]
        assert np.array_equal(slots[3], data[0:2].ravel())
        assert np.array_equal(slots[2], data[2:4].ravel())
    finally:
        rig.close()
