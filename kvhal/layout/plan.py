"""Copy runs and copy plans: the data the layout module hands to the worker (DESIGN §3).

Only the types live here; `kvhal.layout` computes them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class CopyRun:
    """A strided byte run between one device page (of one rank) and the canonical page.

    Fragment i (0 ≤ i < count) moves `fragment_bytes` bytes between
    `local_offset + i * local_stride` in the rank's device page and
    `canonical_offset + i * canonical_stride` in the canonical page. All values are bytes.
    """

    local_offset: int
    canonical_offset: int
    fragment_bytes: int
    count: int
    local_stride: int
    canonical_stride: int


@dataclass(frozen=True, slots=True)
class Copy2D:
    """One `copy_2d_async` call: `height` rows of `width` bytes (addresses and pitches in bytes)."""

    dst: int
    dst_pitch: int
    src: int
    src_pitch: int
    width: int
    height: int


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """The HAL calls that move one set of blocks: 2D copies plus one batch of contiguous copies.

    Attributes:
        copies_2d: One `Copy2D` per strided run that has more than one fragment.
        dsts, srcs, sizes: uint64 arrays of shape (n,) for `copy_batch_async`.
    """

    copies_2d: tuple[Copy2D, ...]
    dsts: np.ndarray
    srcs: np.ndarray
    sizes: np.ndarray

    @property
    def nbytes(self) -> int:
        """Total bytes the plan moves."""
        return int(self.sizes.sum()) + sum(c.width * c.height for c in self.copies_2d)


def merge_plans(plans: list[CopyPlan]) -> CopyPlan:
    """One `CopyPlan` with every copy of `plans`, in order (2D copies, then batch descriptors).

    Returns:
        The concatenation; an empty plan (uint64 arrays of shape (0,)) for no plans.
    """
    if len(plans) == 1:
        return plans[0]
    empty = np.empty(0, dtype=np.uint64)
    return CopyPlan(tuple(c for p in plans for c in p.copies_2d),
                    np.concatenate([p.dsts for p in plans] or [empty]),
                    np.concatenate([p.srcs for p in plans] or [empty]),
                    np.concatenate([p.sizes for p in plans] or [empty]))
