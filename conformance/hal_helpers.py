"""Helpers the HAL conformance tests share: move bytes in and out of any memory kind."""
from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np
import pytest

from kvhal.hal import Allocation, DeviceBackend, InvalidValueError, MemoryKind, host_array


def reference_bytes(nbytes: int, seed: int) -> np.ndarray:
    """Seeded random uint8 array of shape (nbytes,): the reference data."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def write(backend: DeviceBackend, alloc: Allocation, data: np.ndarray) -> None:
    """Fill `alloc` (any kind) with `data` (uint8, len == alloc.nbytes), synchronously."""
    if alloc.kind is not MemoryKind.DEVICE:
        host_array(alloc)[:] = data
        return
    staging = backend.alloc_pinned(alloc.nbytes)
    stream = backend.create_stream()
    try:
        host_array(staging)[:] = data
        backend.copy_async(alloc.ptr, staging.ptr, alloc.nbytes, stream)
        backend.stream_synchronize(stream)
    finally:
        backend.destroy_stream(stream)
        backend.free(staging)


def read(backend: DeviceBackend, alloc: Allocation) -> np.ndarray:
    """A copy of `alloc`'s bytes (any kind), uint8 shape (nbytes,), read synchronously."""
    if alloc.kind is not MemoryKind.DEVICE:
        return host_array(alloc).copy()
    staging = backend.alloc_pinned(alloc.nbytes)
    stream = backend.create_stream()
    try:
        backend.copy_async(staging.ptr, alloc.ptr, alloc.nbytes, stream)
        backend.stream_synchronize(stream)
        return host_array(staging).copy()
    finally:
        backend.destroy_stream(stream)
        backend.free(staging)


def alloc_kind(backend: DeviceBackend, kind: str, nbytes: int) -> Allocation:
    """Allocate `nbytes` of kind "device" or "host" (pinned)."""
    return backend.alloc_device(nbytes) if kind == "device" else backend.alloc_pinned(nbytes)


@contextlib.contextmanager
def refused(arg: str | set[str], index: int | None = None) -> Iterator[pytest.ExceptionInfo]:
    """Expect the block to raise `InvalidValueError` naming the offending argument: its `arg`
    is `arg` (or one of a set), and its `index` is `index` when given (an array argument's
    entry or row). The message is free text; only the attributes are the contract."""
    with pytest.raises(InvalidValueError) as info:
        yield info
    error = info.value
    allowed = {arg} if isinstance(arg, str) else arg
    assert getattr(error, "arg", None) in allowed, (
        f"InvalidValueError.arg is {getattr(error, 'arg', None)!r}, expected "
        f"{' or '.join(map(repr, sorted(allowed)))}: {error}")
    if index is not None:
        assert error.index == index, (f"InvalidValueError.index is {error.index!r}, expected "
                                      f"{index}: {error}")
