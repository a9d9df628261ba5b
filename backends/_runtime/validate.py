"""Argument checks every backend's copies share: 2D geometry and batch descriptor arrays.

Backend-neutral (they take the backend's name and its `RangeRegistry`), so the cpu reference
can use them too.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from kvhal.hal import InvalidValueError, as_u64


def check_2d(backend: str, dst_pitch: int, src_pitch: int, width: int, height: int) -> bool:
    """Validate 2D copy geometry; False if the copy is empty (width or height 0).

    Raises:
        InvalidValueError: a negative value, or a pitch smaller than width.
    """
    for what, value in (("dst_pitch", dst_pitch), ("src_pitch", src_pitch), ("width", width),
                        ("height", height)):
        if value < 0:
            raise InvalidValueError(f"{what} must be ≥ 0, got {value}", backend=backend)
    if width == 0 or height == 0:
        return False
    for what, pitch in (("dst_pitch", dst_pitch), ("src_pitch", src_pitch)):
        if pitch < width:
            raise InvalidValueError(f"{what} {pitch} < width {width}", backend=backend)
    return True


def batch_arrays(backend: str, ranges: Any, dsts: Any, srcs: Any,
                 sizes: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validated uint64 arrays (dsts, srcs, sizes) of shape (n,), zero-size entries dropped.

    Args:
        backend: Backend name for errors.
        ranges: The backend's `RangeRegistry` of live allocations.

    Raises:
        InvalidValueError: arrays differ in length, are not 1-D, have negative entries, or a
            range lies outside the live allocations.
    """
    d = as_u64(dsts, "dsts", backend)
    s = as_u64(srcs, "srcs", backend)
    n = as_u64(sizes, "sizes", backend)
    if not (len(d) == len(s) == len(n)):
        raise InvalidValueError(f"batch arrays differ in length: dsts={len(d)} srcs={len(s)} "
                                f"sizes={len(n)}", backend=backend)
    keep = n > 0
    if not keep.all():
        d, s, n = d[keep], s[keep], n[keep]
    if len(n):
        ranges.check_many(d, n, "dsts")
        ranges.check_many(s, n, "srcs")
    return d, s, n
