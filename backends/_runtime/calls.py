"""The native batch-copy call, in the two shapes the bindings allow.

- binding: cuda-python's `cudaMemcpyBatchAsync(dsts, srcs, sizes, count, attrs, attrsIdxs,
  numAttrs, stream)` takes Python lists (its generated signature, cuda-python 12.8–13.x) and one
  attribute set for the whole chunk (CUDA requires numAttrs ≥ 1).
- ctypes: hip-python's generated `hipMemcpyBatchAsync` treats the arrays as outputs, so the
  symbol in libamdhip64 is called directly with the numpy arrays' addresses, `numAttrs = 0`
  (ROCm 7.2 rejects numAttrs > 0) and a `failIdx` out-argument (HIP header signature:
  `hipMemcpyBatchAsync(void**, void**, size_t*, size_t, hipMemcpyAttributes*, size_t*, size_t,
  size_t*, hipStream_t)`).
"""
from __future__ import annotations

import ctypes
from typing import Any, Callable

import numpy as np

from .errors import Errors, code_of
from .vendor import VendorTable

#: A batch call: (dsts, srcs, sizes, h2d_pinned, stream_handle) for one chunk; raises HalError.
BatchCall = Callable[[np.ndarray, np.ndarray, np.ndarray, bool, Any], None]


def binding_batch_call(module: Any, table: VendorTable, errors: Errors) -> BatchCall:
    """The batch call through the binding (CUDA), with one stream-ordered attribute set.

    "Source access order any" lets the runtime read sources out of stream order; it is used
    only when every source is pinned host memory and every destination is device memory
    (`h2d_pinned`), the one case where it is safe.
    """
    api = table.api("memcpy_batch_async")
    fn = getattr(module, api)
    order = getattr(module, table.prefix + "MemcpySrcAccessOrder")

    def attrs(any_order: bool) -> Any:
        attr = getattr(module, table.prefix + "MemcpyAttributes")()
        attr.srcAccessOrder = getattr(
            order, table.prefix + ("MemcpySrcAccessOrderAny" if any_order
                                   else "MemcpySrcAccessOrderStream"))
        return attr

    stream_order, any_order = attrs(False), attrs(True)

    def call(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, h2d_pinned: bool,
             stream: Any) -> None:
        attr = any_order if h2d_pinned else stream_order
        result = fn(dsts.tolist(), srcs.tolist(), sizes.tolist(), len(sizes), [attr], [0], 1,
                    stream)
        errors.check(result, api, f"batch of {len(sizes)} copies")

    return call


def load_ctypes_symbol(table: VendorTable) -> Any:
    """The batch symbol from `table.batch.library`, typed; None if the library or symbol is
    missing."""
    try:
        fn = getattr(ctypes.CDLL(table.batch.library), table.api("memcpy_batch_async"))
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    return fn


def ctypes_batch_call(fn: Any, table: VendorTable, errors: Errors, fail_idx: bool) -> BatchCall:
    """The batch call through ctypes (HIP): arrays by address, no attributes."""
    api = table.api("memcpy_batch_async")
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    fn.argtypes = ([vp, vp, vp, sz, vp, vp, sz] + ([vp] if fail_idx else []) + [vp])

    def call(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, h2d_pinned: bool,
             stream: Any) -> None:
        failed = ctypes.c_size_t(0)
        tail = ([ctypes.addressof(failed)] if fail_idx else []) + [int(stream)]
        code = code_of(fn(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, len(sizes),
                          None, None, 0, *tail))
        if code != errors.success:
            where = f"; failIdx={failed.value}" if fail_idx else ""
            raise errors.error(code, api, f"batch of {len(sizes)} copies{where}")

    return call
