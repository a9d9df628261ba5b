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
        self._within: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # n -> (offsets, sizes)

    def __call__(self, block_ids: np.ndarray, slot_addr: int, direction: Direction) -> CopyPlan:
        """See `kvhal.engine.worker.Planner`; one batch of `len(block_ids)` contiguous copies.

        Raises:
            ValueError: a block id is outside [0, num_blocks).
        """
        ids = np.asarray(block_ids, dtype=np.int64).astype(np.uint64)  # negatives wrap high
        if (ids >= self.num_blocks).any():
            raise ValueError(f"block ids {block_ids.tolist()} outside [0, {self.num_blocks})")
        device = ids * np.uint64(self.block_stride) + np.uint64(self.device_base)
        within = self._within.get(len(ids))
        if within is None:
            within = self._within[len(ids)] = (
                np.arange(len(ids), dtype=np.uint64) * np.uint64(self.block_bytes),
                np.full(len(ids), self.block_bytes, dtype=np.uint64))
        host = within[0] + np.uint64(slot_addr)
        sizes = within[1]
        if direction is Direction.D2H:
            return CopyPlan((), host, device, sizes)
        return CopyPlan((), device, host, sizes)
