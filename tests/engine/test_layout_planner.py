"""The engine with real layouts: chunks stored at one TP size / layout load at another."""
from __future__ import annotations

import numpy as np
import pytest

from kvhal.backends.cpu import CpuBackend
from kvhal.engine import LayoutPlanner, Manager, Worker
from kvhal.hal import address_array
from kvhal.host import HostRegion, LRUPolicy, SlotTable, host_geometry
from kvhal.layout import attention_spec, chunk_mapper, device_cache, get_layout
from tests.layout.test_plan import NumpyTensor

from .rig import synthetic_keys

SPEC = attention_spec(num_layers=2, num_kv_heads=4, head_size=8, dtype="bf16", block_size=4)
HEADS, TOKENS, HEAD_SIZE, NUM_BLOCKS, BLOCKS_PER_CHUNK = 4, 4, 8, 8, 2


def to_packed_hnd(tensor: np.ndarray, layout: str) -> np.ndarray:
    """A layer tensor of `layout` as (num_blocks, heads, T, 2*D) (K‖V per row), the oracle."""
    if layout == "packed-hnd":
        return tensor
    if layout == "packed-nhd":
        return tensor.transpose(0, 2, 1, 3)
    k_v = tensor if layout == "split-hnd" else tensor.transpose(0, 1, 3, 2, 4)  # (b,2,h,T,D)
    return np.concatenate([k_v[:, 0], k_v[:, 1]], axis=-1)


class Rank:
    """One TP rank: its layer tensors in "device" memory and a worker planning with the layout."""

    def __init__(self, backend, region, layout: str, tp: int, rank: int):
        self.layout = layout
        shape = get_layout(layout).shape(SPEC.groups[0], HEADS // tp, NUM_BLOCKS)
        nbytes = int(np.prod(shape)) * 2
        self.allocs = [backend.alloc_device(nbytes) for _ in range(SPEC.num_layers)]
        self.tensors = [address_array(a.ptr, nbytes).view(np.uint16).reshape(shape)
                        for a in self.allocs]
        self.mapper = chunk_mapper(SPEC, layout, tp, rank, BLOCKS_PER_CHUNK)
        planner = LayoutPlanner(self.mapper, device_cache(self.mapper, [NumpyTensor(t) for t in
                                                                       self.tensors]))
        self.worker = Worker(backend, planner, host_ptr=region.ptr,
                             slot_bytes=region.geometry.slot_bytes)

    def heads(self, layer: int, block_ids) -> np.ndarray:
        """(blocks, local heads, T, 2*D) of one layer, whatever the layout."""
        return to_packed_hnd(self.tensors[layer], self.layout)[block_ids]


def run_job(ranks, submit, job_id, block_ids, slots) -> int:
    """Every rank runs its share of one job; the job's num_ok is the smallest over ranks."""
    for r in ranks:
        getattr(r.worker, submit)(job_id, block_ids, slots)
    oks = []
    for r in ranks:
        r.worker.wait(job_id)
        oks += [res.num_ok for res in r.worker.get_finished()]
    return min(oks)


@pytest.mark.parametrize("store,load", [(("packed-hnd", 2), ("packed-hnd", 1)),
                                        (("split-nhd", 1), ("packed-nhd", 2)),
                                        (("packed-nhd", 2), ("split-hnd", 4))],
                         ids=lambda p: f"{p[0]}-tp{p[1]}")
def test_chunk_stored_at_one_tp_and_layout_loads_at_another(store, load):
    backend = CpuBackend(chaos_seed=5)
    chunk_nbytes = chunk_mapper(SPEC, "packed-hnd", 1, 0, BLOCKS_PER_CHUNK).chunk.chunk_bytes
    geo = host_geometry(chunk_nbytes, 4 * host_geometry(chunk_nbytes, 1 << 30).slot_bytes)
    region = HostRegion.allocate(backend, geo)
    manager = Manager(SlotTable(geo.capacity, LRUPolicy(geo.capacity)),
                      slot_bytes=geo.slot_bytes, chunk_nbytes=chunk_nbytes, emit_events=False)
    writers = [Rank(backend, region, store[0], store[1], r) for r in range(store[1])]
    readers = [Rank(backend, region, load[0], load[1], r) for r in range(load[1])]
    rng = np.random.default_rng(0)
    for rank in writers:
        for t in rank.tensors:
            t[:] = rng.integers(0, 1 << 16, t.shape, dtype=np.uint16)
    try:
        keys = synthetic_keys(1)
        plan = manager.prepare_store(keys)
        stored = run_job(writers, "submit_store", plan.job_id, np.array([[1, 5]]), plan.slots)
        manager.complete_store(plan.job_id, stored)
        plan = manager.prepare_load(keys)
        loaded = run_job(readers, "submit_load", plan.job_id, np.array([[2, 6]]), plan.slots)
        manager.complete_load(plan.job_id, loaded)
        assert (stored, loaded) == (1, 1)
        for layer in range(SPEC.num_layers):
            want = np.concatenate([w.heads(layer, [1, 5]) for w in writers], axis=1)
            got = np.concatenate([r.heads(layer, [2, 6]) for r in readers], axis=1)
            assert np.array_equal(got, want)
    finally:
        for rank in writers + readers:
            rank.worker.close()
            for a in rank.allocs:
                backend.free(a)
        region.close()
