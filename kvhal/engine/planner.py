"""`BlockPlanner`: the simplest chunk layout, for single-buffer caches, harnesses and tests.

Device block b is `block_bytes` contiguous bytes at `device_base + b * block_stride`; a chunk's
host slot holds its blocks back to back (block j of the chunk at `slot + j * block_bytes`).
Real model layouts (layers, TP ranks, NHD/HND) come from `kvhal.layout`.
"""
from __future__ import annotations

import numpy as np

from kvhal.layout.plan import CopyPlan

from .types import Direction


class BlockPlanner:
    """A `Planner` for the layout in the module docstring.

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

    def __call__(self, block_ids: np.ndarray, slot_addr: int, direction: Direction) -> CopyPlan:
        """See `kvhal.engine.worker.Planner`; one batch of `len(block_ids)` contiguous copies.

        Raises:
            ValueError: a block id is outside [0, num_blocks).
        """
        ids = np.asarray(block_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_blocks):
            raise ValueError(f"block ids {ids.tolist()} outside [0, {self.num_blocks})")
        device = (np.uint64(self.device_base)
                  + ids.astype(np.uint64) * np.uint64(self.block_stride))
        host = np.uint64(slot_addr) + np.arange(len(ids), dtype=np.uint64) * np.uint64(
            self.block_bytes)
        sizes = np.full(len(ids), self.block_bytes, dtype=np.uint64)
        if direction is Direction.D2H:
            return CopyPlan((), host, device, sizes)
        return CopyPlan((), device, host, sizes)
