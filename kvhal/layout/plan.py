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


#: `CopyPlan.copies_2d` of a plan without 2D copies: uint64, shape (0, 6), read-only.
NO_COPIES_2D = np.empty((0, 6), dtype=np.uint64)
NO_COPIES_2D.flags.writeable = False


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """The HAL calls that move one set of blocks: one batch of 2D copies plus one batch of
    contiguous copies.

    Attributes:
        copies_2d: uint64 array of shape (m, 6) for `copy_2d_batch_async`: one row
            (dst, dst_pitch, src, src_pitch, width, height) per strided run that has more than
            one fragment (`kvhal.hal.COPY_2D_COLUMNS`; bytes, height in rows).
        dsts, srcs, sizes: uint64 arrays of shape (n,) for `copy_batch_async`.
    """

    copies_2d: np.ndarray
    dsts: np.ndarray
    srcs: np.ndarray
    sizes: np.ndarray

    @property
    def nbytes(self) -> int:
        """Total bytes the plan moves."""
        return int(self.sizes.sum()) + int((self.copies_2d[:, 4] * self.copies_2d[:, 5]).sum())


def merge_plans(plans: list[CopyPlan]) -> CopyPlan:
    """One `CopyPlan` with every copy of `plans`, in order (2D copies, then batch descriptors).

    Returns:
        The concatenation; an empty plan (uint64 arrays of shape (0, 6) and (0,)) for no plans.
    """
    if len(plans) == 1:
        return plans[0]
    empty = np.empty(0, dtype=np.uint64)
    return CopyPlan(np.concatenate([p.copies_2d for p in plans] or [NO_COPIES_2D]),
                    np.concatenate([p.dsts for p in plans] or [empty]),
                    np.concatenate([p.srcs for p in plans] or [empty]),
                    np.concatenate([p.sizes for p in plans] or [empty]))
