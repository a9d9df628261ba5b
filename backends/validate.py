"""Argument checks every backend shares (cpu, cuda, rocm): copies, 2D copies, batch arrays,
host ranges.

Backend-neutral (they take the backend's name and its `RangeRegistry`), so the cpu reference
can use them too.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from kvhal.backends.cpu.memory import unmapped_or_read_only
from kvhal.hal import InvalidValueError, as_int, as_u64


def copy_args(backend: str, ranges: Any, dst: Any, src: Any, nbytes: Any) -> int:
    """Validate one `copy_async`; returns nbytes as an int (0: nothing to copy).

    Raises:
        InvalidValueError: an argument is not an int in [0, 2**64), or a range lies outside
            the live allocations in `ranges` (a `RangeRegistry`).
    """
    dst, src = as_int(dst, "dst", backend), as_int(src, "src", backend)
    nbytes = as_int(nbytes, "nbytes", backend)
    if nbytes:
        ranges.check(dst, nbytes, "dst")
        ranges.check(src, nbytes, "src")
    return nbytes


def copy_2d_args(backend: str, ranges: Any, dst: Any, dst_pitch: Any, src: Any,
                 src_pitch: Any, width: Any, height: Any) -> tuple[int, ...] | None:
    """Validate one `copy_2d_async`; returns (dst, dst_pitch, src, src_pitch, width, height)
    as ints, or None if the copy is empty (width or height 0).

    Raises:
        InvalidValueError: an argument is not an int in [0, 2**64), a pitch is smaller than
            width, or a range lies outside the live allocations in `ranges`.
    """
    args = tuple(as_int(v, what, backend) for v, what in (
        (dst, "dst"), (dst_pitch, "dst_pitch"), (src, "src"), (src_pitch, "src_pitch"),
        (width, "width"), (height, "height")))
    dst, dst_pitch, src, src_pitch, width, height = args
    if width == 0 or height == 0:
        return None
    for what, pitch in (("dst_pitch", dst_pitch), ("src_pitch", src_pitch)):
        if pitch < width:
            raise InvalidValueError(f"{what} {pitch} < width {width}", backend=backend,
                                    arg=what)
    ranges.check(dst, (height - 1) * dst_pitch + width, "dst")
    ranges.check(src, (height - 1) * src_pitch + width, "src")
    return args


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
                                f"sizes={len(n)}", backend=backend,
                                arg="srcs" if len(s) != len(d) else "sizes")
    keep = n > 0
    if not keep.all():
        d, s, n = d[keep], s[keep], n[keep]
    if len(n):
        ranges.check_many(d, n, "dsts")
        ranges.check_many(s, n, "srcs")
    return d, s, n


def host_range(backend: str, ptr: Any, nbytes: Any) -> tuple[int, int]:
    """Validated (ptr, nbytes) for `register_host`; ptr is 0 when nbytes is 0.

    Raises:
        InvalidValueError: ptr or nbytes not an int in [0, 2**64), ptr NULL with nbytes > 0, or
            [ptr, ptr + nbytes) not mapped read-write in this process (`cudaHostRegister`
            refuses an unmapped range too; checking first names the first bad byte).
    """
    nbytes = as_int(nbytes, "nbytes", backend)
    if nbytes == 0:
        return 0, 0
    ptr = as_int(0 if ptr is None else ptr, "ptr", backend)
    if not ptr:
        raise InvalidValueError("register_host: ptr is NULL", backend=backend, arg="ptr")
    bad = unmapped_or_read_only(ptr, nbytes)
    if bad is not None:
        raise InvalidValueError(f"register_host: [{ptr:#x}, +{nbytes}) is not mapped read-write "
                                f"in this process (first bad byte {bad:#x})", backend=backend,
                                arg="ptr", api="register_host")
    return ptr, nbytes
