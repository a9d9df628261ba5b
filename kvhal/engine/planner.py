"""Planners: one chunk's device block ids + host slot address → the `CopyPlan` that moves it
(and, where a planner offers `plan_job`, a whole job's chunks → one `CopyPlan`).

`LayoutPlanner` covers real model layouts (layers, TP ranks, NHD/HND, MLA) through
`kvhal.layout`. `BlockPlanner` is the simplest layout, for single-buffer caches, harnesses and
benchmarks: device block b is `block_bytes` contiguous bytes at `device_base + b *
block_stride`, and a chunk's host slot holds its blocks back to back.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from kvhal.layout import plan_copies, plan_job_copies
from kvhal.layout.plan import NO_COPIES_2D, CopyPlan

from .types import Direction


class BlockPlanner:
    """A `JobPlanner` for one contiguous buffer of blocks (see the module docstring).

    Args:
        device_base: Address of device block 0 (bytes).
        block_bytes: Bytes per block (> 0).
        num_blocks: Number of device blocks; block ids outside [0, num_blocks) are refused.
        block_stride: Bytes between consecutive device blocks (default block_bytes).
    """

    def __init__(self, device_base: int, block_bytes: int, num_blocks: int,
                 block_stride: int | None = None):
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be > 0, got {block_bytes}")
        self.device_base = device_base
        self.block_bytes = block_bytes
        self.num_blocks = num_blocks
        self.block_stride = block_bytes if block_stride is None else block_stride
        self._offsets: dict[int, np.ndarray] = {}  # blocks per chunk -> offsets in the slot

    def __call__(self, block_ids: np.ndarray, slot_addr: int, direction: Direction) -> CopyPlan:
        """See `kvhal.engine.worker.Planner`; one batch of `len(block_ids)` contiguous copies.

        Raises:
            ValueError: a block id is outside [0, num_blocks).
        """
        return self.plan_job(np.asarray(block_ids).reshape(1, -1), np.array([slot_addr]),
                             direction)

    def plan_job(self, block_ids: np.ndarray, slot_addrs: np.ndarray,
                 direction: Direction) -> CopyPlan:
        """See `kvhal.engine.worker.JobPlanner`: the copies of every chunk of a job, chunk-major.

        Args:
            block_ids: int array (n, blocks_per_chunk): chunk i's device block ids.
            slot_addrs: int array (n,): address of chunk i's host slot (bytes).
            direction: D2H or H2D.

        Returns:
            A `CopyPlan` of n * blocks_per_chunk `block_bytes`-byte copies (no 2D copies):
            chunk i's block j moves to/from `slot_addrs[i] + j * block_bytes`.

        Raises:
            ValueError: a block id is outside [0, num_blocks).
        """
        signed = np.asarray(block_ids, dtype=np.int64)
        ids = signed.astype(np.uint64)  # negatives wrap high
        bad = ids >= self.num_blocks
        if bad.any():
            raise ValueError(f"block ids {signed[bad].tolist()} outside [0, {self.num_blocks})")
        device = (ids * np.uint64(self.block_stride) + np.uint64(self.device_base)).ravel()
        offsets = self._offsets.get(ids.shape[1])
        if offsets is None:
            offsets = self._offsets[ids.shape[1]] = (
                np.arange(ids.shape[1], dtype=np.uint64) * np.uint64(self.block_bytes))
        host = (np.asarray(slot_addrs, dtype=np.int64).astype(np.uint64)[:, None]
                + offsets).ravel()
        sizes = np.full(ids.size, self.block_bytes, dtype=np.uint64)
        if direction is Direction.D2H:
            return CopyPlan(NO_COPIES_2D, host, device, sizes)
        return CopyPlan(NO_COPIES_2D, device, host, sizes)


class LayoutPlanner:
    """A `JobPlanner` over `kvhal.layout`: one TP rank's chunk mapper and its layer tensors.

    Args:
        mapper: From `kvhal.layout.chunk_mapper(spec, layout, tp_size, tp_rank,
            blocks_per_chunk)`; the host slot holds `mapper.chunk.chunk_bytes` canonical bytes.
        device: From `kvhal.layout.device_cache(mapper, layer_tensors)`.
        expand_up_to: Passed to `plan_copies` (runs of at most this many fragments become
            batch descriptors instead of 2D copies).
    """

    def __init__(self, mapper: Any, device: Any, expand_up_to: int = 1):
        self.mapper = mapper
        self.device = device
        self.expand_up_to = expand_up_to

    def __call__(self, block_ids: np.ndarray, slot_addr: int, direction: Direction) -> CopyPlan:
        """See `kvhal.engine.worker.Planner`; D2H moves only this rank's elected bytes, H2D
        fills every replica (`kvhal.layout.plan_copies`).

        Raises:
            LayoutError: bad block ids (a `ValueError`: the worker fails the chunk).
        """
        return plan_copies(self.mapper, block_ids, self.device, slot_addr, direction.value,
                           self.expand_up_to)

    def plan_job(self, block_ids: np.ndarray, slot_addrs: np.ndarray,
                 direction: Direction) -> CopyPlan:
        """See `kvhal.engine.worker.JobPlanner`: every chunk of a job in one vectorised call
        (`kvhal.layout.plan_job_copies`).

        Raises:
            LayoutError: bad block ids or slot addresses (the worker then plans chunk by chunk).
        """
        return plan_job_copies(self.mapper, block_ids, self.device, slot_addrs,
                               direction.value, self.expand_up_to)
