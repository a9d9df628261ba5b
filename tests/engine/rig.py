"""A small engine set-up on the cpu backend: device blocks, host region, manager, worker.

Device blocks are one contiguous "device" allocation (`BlockPlanner` layout); `dev` is a uint8
view of it, shape (num_blocks, block_bytes), so tests write KV and read back bytes directly.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from kvhal.backends.cpu import CpuBackend
from kvhal.config import parse_config
from kvhal.engine import BlockPlanner, Manager, TransferResult, Worker, build_manager
from kvhal.hal import Stream, address_array
from kvhal.host import HostRegion, host_geometry
from kvhal.keys import ChunkKey, block_hashes, chunk_keys, hash_function, namespace_digest, none_hash

BLOCK_TOKENS = 16
SEED = "0"


def namespace(**overrides: Any) -> bytes:
    """A namespace digest with test defaults, any field overridden."""
    fields = dict(weights="xxh3-128:toy-model-r1", kv_dtype="bfloat16", format_id="kvhal-hnd-v1",
                  tokens_per_chunk=256, hash_name="sha256", hash_seed=SEED, tenant_salt=None)
    fields.update(overrides)
    return namespace_digest(**fields)


def prompt_keys(tokens: Sequence[int], blocks_per_chunk: int, ns: bytes) -> list[ChunkKey]:
    """Chunk keys of a prompt with 16-token blocks and sha256 (vLLM's default)."""
    fn = hash_function("sha256")
    return chunk_keys(block_hashes(tokens, BLOCK_TOKENS, fn, root=none_hash("sha256", SEED)),
                      blocks_per_chunk, ns)


@dataclass
class Rig:
    """See module docstring. `chunk_blocks(i)` are the device block ids a test gives chunk i."""

    backend: CpuBackend
    manager: Manager
    worker: Worker
    region: HostRegion
    dev: np.ndarray
    blocks_per_chunk: int
    block_bytes: int
    allocs: list = field(default_factory=list)

    def store(self, keys: Sequence[ChunkKey], block_ids: np.ndarray, after=None
              ) -> TransferResult | None:
        """prepare_store + submit + wait + complete_store; None if nothing was due."""
        plan = self.manager.prepare_store(keys)
        if plan is None:
            return None
        self.worker.submit_store(plan.job_id, block_ids[plan.indices], plan.slots, after=after)
        return self.finish(plan.job_id)

    def load(self, keys: Sequence[ChunkKey], block_ids: np.ndarray, pin_owner=None
             ) -> TransferResult | None:
        """prepare_load + submit + wait + complete_load; None if nothing was resident."""
        plan = self.manager.prepare_load(keys, pin_owner)
        if plan is None:
            return None
        self.worker.submit_load(plan.job_id, block_ids[:len(plan.keys)], plan.slots)
        return self.finish(plan.job_id)

    def finish(self, job_id: int) -> TransferResult:
        """Wait for one job, complete it in the manager, return its result."""
        self.worker.wait(job_id)
        (result,) = [r for r in self.worker.get_finished() if r.job_id == job_id]
        complete = (self.manager.complete_store if result.direction.value == "d2h"
                    else self.manager.complete_load)
        complete(result.job_id, result.num_ok)
        return result

    def close(self) -> None:
        self.worker.close()
        self.manager.close()
        self.region.close()
        for a in self.allocs:
            self.backend.free(a)


def make_rig(*, capacity: int = 64, blocks_per_chunk: int = 2, block_bytes: int = 512,
             num_blocks: int = 256, chaos_seed: int | None = None, policy: str = "lru",
             tiers: Sequence[dict] = (), backend: CpuBackend | None = None,
             ns: bytes | None = None, config: dict | None = None,
             tokens_per_chunk: int | None = None) -> Rig:
    """A rig whose host tier holds exactly `capacity` chunks (slot = chunk rounded to a page);
    `config`: more config keys; `tokens_per_chunk`: for the cost model."""
    backend = backend or CpuBackend(chaos_seed=chaos_seed)
    chunk_nbytes = blocks_per_chunk * block_bytes
    slot_bytes = host_geometry(chunk_nbytes, 1 << 40).slot_bytes
    cfg = parse_config({"cpu_bytes_to_use": capacity * slot_bytes,
                        "blocks_per_chunk": blocks_per_chunk, "eviction_policy": policy,
                        "secondary_tiers": list(tiers), **(config or {})})
    geo = host_geometry(chunk_nbytes, cfg.cpu_bytes_to_use)
    region = HostRegion.allocate(backend, geo)
    manager = build_manager(cfg, geo, region.view, ns or namespace(), emit_events=False,
                            tokens_per_chunk=tokens_per_chunk)
    dev_alloc = backend.alloc_device(num_blocks * block_bytes)
    dev = address_array(dev_alloc.ptr, dev_alloc.nbytes).reshape(num_blocks, block_bytes)
    worker = Worker(backend, BlockPlanner(dev_alloc.ptr, block_bytes, num_blocks),
                    host_ptr=region.ptr, slot_bytes=geo.slot_bytes)
    return Rig(backend, manager, worker, region, dev, blocks_per_chunk, block_bytes, [dev_alloc])


def chunk_blocks(first_block: int, num_chunks: int, blocks_per_chunk: int) -> np.ndarray:
    """Block ids (num_chunks, blocks_per_chunk) numbered consecutively from `first_block`."""
    return np.arange(first_block, first_block + num_chunks * blocks_per_chunk,
                     dtype=np.int64).reshape(num_chunks, blocks_per_chunk)


def synthetic_keys(n: int, ns: bytes | None = None, tag: int = 0) -> list[ChunkKey]:
    """n distinct keys (hash bytes derived from tag and index), for bookkeeping tests."""
    ns = ns or namespace()
    return [ChunkKey(ns, 0, (tag * 1_000_003 + i).to_bytes(8, "big")) for i in range(n)]


class CopyHookBackend(CpuBackend):
    """A cpu backend that calls `before_copy(stream)` before it queues each copy (1D, 2D,
    batched, 2D-batched): the one place test backends that delay or hold copies hook in."""

    def before_copy(self, stream: Stream) -> None:
        """Called with the copy's stream before the copy is queued. Default: nothing."""

    def copy_async(self, dst, src, nbytes, stream):
        self.before_copy(stream)
        super().copy_async(dst, src, nbytes, stream)

    def copy_2d_async(self, dst, dst_pitch, src, src_pitch, width, height, stream):
        self.before_copy(stream)
        super().copy_2d_async(dst, dst_pitch, src, src_pitch, width, height, stream)

    def copy_batch_async(self, dsts, srcs, sizes, stream):
        self.before_copy(stream)
        super().copy_batch_async(dsts, srcs, sizes, stream)

    def copy_2d_batch_async(self, copies, stream):
        self.before_copy(stream)
        super().copy_2d_batch_async(copies, stream)


class FaultyLateStreams(CopyHookBackend):
    """A cpu backend on which every copy queued on a stream that `late(stream)` picks starts
    `delay_s` late, as if a long kernel ran ahead of it on that stream. The default is far
    above chaos mode's delays (≤ 2 ms per operation), so a copy racing it without a stream
    wait runs first every time."""

    def __init__(self, late: Callable[[Stream], bool], delay_s: float = 0.05, **kwargs):
        super().__init__(**kwargs)
        self.late, self.delay_s = late, delay_s

    def before_copy(self, stream: Stream) -> None:
        if self.late(stream):
            self._worker(stream).submit(functools.partial(time.sleep, self.delay_s))
