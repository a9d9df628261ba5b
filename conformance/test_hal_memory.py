"""HAL conformance: allocation, alignment, exact sizes, zero size, OOM, bad frees."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kvhal.hal import MIN_ALIGNMENT, InvalidValueError, MemoryKind, OutOfMemoryError

from .conftest import require
from .hal_helpers import read, reference_bytes, write

SIZES = [1, 255, 256, 4097, (1 << 20) + 3]


@pytest.mark.parametrize("nbytes", SIZES)
@pytest.mark.parametrize("kind", ["device", "pinned"])
def test_alloc_is_exact_and_aligned(backend, kind, nbytes):
    alloc = (backend.alloc_device(nbytes) if kind == "device"
             else backend.alloc_pinned(nbytes))
    try:
        assert alloc.nbytes == nbytes
        assert alloc.ptr % MIN_ALIGNMENT == 0
        assert alloc.kind is (MemoryKind.DEVICE if kind == "device" else MemoryKind.PINNED)
        data = reference_bytes(nbytes, seed=nbytes)
        write(backend, alloc, data)
        np.testing.assert_array_equal(read(backend, alloc), data)
    finally:
        backend.free(alloc)


@pytest.mark.parametrize("kind", ["device", "pinned", "registered"])
def test_zero_size_alloc_and_free(backend, kind):
    if kind == "registered":
        require(backend, "host_register")
        alloc = backend.register_host(0, 0)
    else:
        alloc = backend.alloc_device(0) if kind == "device" else backend.alloc_pinned(0)
    assert alloc.nbytes == 0
    backend.free(alloc)


@pytest.mark.parametrize("nbytes", [1, 4096, 3 << 20])
def test_registered_host_memory_round_trips(backend, nbytes):
    require(backend, "host_register")
    owner = (ctypes.c_uint8 * nbytes)()
    reg = backend.register_host(ctypes.addressof(owner), nbytes)
    dev = backend.alloc_device(nbytes)
    try:
        assert reg.kind is MemoryKind.REGISTERED and reg.nbytes == nbytes
        data = reference_bytes(nbytes, seed=7)
        np.ctypeslib.as_array(owner)[:] = data
        stream = backend.create_stream()
        backend.copy_async(dev.ptr, reg.ptr, nbytes, stream)
        backend.stream_synchronize(stream)
        np.ctypeslib.as_array(owner)[:] = 0
        backend.copy_async(reg.ptr, dev.ptr, nbytes, stream)
        backend.stream_synchronize(stream)
        backend.destroy_stream(stream)
        np.testing.assert_array_equal(np.ctypeslib.as_array(owner), data)
    finally:
        backend.free(dev)
        backend.free(reg)


def test_page_locked_host_is_really_locked(backend):
    require(backend, "page_locked_host")
    def locked_kib() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmLck:"))
    before = locked_kib()
    alloc = backend.alloc_pinned(8 << 20)
    try:
        assert locked_kib() - before >= 8 << 10
    finally:
        backend.free(alloc)


def test_device_oom_raises_typed_error(backend):
    with pytest.raises(OutOfMemoryError):
        backend.alloc_device(1 << 60)


def test_pinned_oom_raises_typed_error(backend):
    with pytest.raises(OutOfMemoryError):
        backend.alloc_pinned(1 << 60)


@pytest.mark.parametrize("nbytes", [-1, -4096])
def test_negative_size_is_invalid(backend, nbytes):
    with pytest.raises(InvalidValueError):
        backend.alloc_device(nbytes)


def test_double_free_is_invalid(backend):
    alloc = backend.alloc_device(4096)
    backend.free(alloc)
    with pytest.raises(InvalidValueError):
        backend.free(alloc)


def test_errors_carry_backend_name(backend):
    with pytest.raises(OutOfMemoryError) as info:
        backend.alloc_device(1 << 60)
    assert info.value.backend == backend.name
