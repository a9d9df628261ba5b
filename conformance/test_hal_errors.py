"""HAL conformance: bad arguments fail at the call with `InvalidValueError`, never later on the
stream, never as a crash and never as silently different bytes."""
from __future__ import annotations

import mmap

import numpy as np
import pytest

from kvhal.hal import Event, InvalidValueError, Stream

from .conftest import require
from .hal_helpers import read, reference_bytes, write

NOT_INTS = [None, "64", 64.0, np.float64(64), True, 1 << 64, -1]


@pytest.fixture
def stream(backend):
    s = backend.create_stream()
    yield s
    backend.destroy_stream(s)


@pytest.fixture
def buf(backend):
    a = backend.alloc_device(4096)
    write(backend, a, reference_bytes(4096, seed=3))
    yield a
    backend.free(a)


def _unchanged(backend, stream, buf) -> None:
    """Nothing was queued: the stream syncs cleanly and the buffer holds its reference bytes."""
    backend.stream_synchronize(stream)
    np.testing.assert_array_equal(read(backend, buf), reference_bytes(4096, seed=3))


@pytest.mark.parametrize("value", NOT_INTS, ids=repr)
@pytest.mark.parametrize("arg", ["dst", "src", "nbytes"])
def test_copy_async_refuses_non_int_arguments(backend, stream, buf, arg, value):
    args = {"dst": buf.ptr, "src": buf.ptr + 2048, "nbytes": 64} | {arg: value}
    with pytest.raises(InvalidValueError, match=arg):
        backend.copy_async(args["dst"], args["src"], args["nbytes"], stream)
    _unchanged(backend, stream, buf)


@pytest.mark.parametrize("value", NOT_INTS, ids=repr)
@pytest.mark.parametrize("arg", ["dst_pitch", "src_pitch", "width", "height"])
def test_copy_2d_refuses_non_int_arguments(backend, stream, buf, arg, value):
    args = {"dst_pitch": 32, "src_pitch": 32, "width": 16, "height": 4} | {arg: value}
    with pytest.raises(InvalidValueError, match=arg):
        backend.copy_2d_async(buf.ptr, args["dst_pitch"], buf.ptr + 2048, args["src_pitch"],
                              args["width"], args["height"], stream)
    _unchanged(backend, stream, buf)


def test_copy_2d_huge_height_is_refused(backend, stream, buf):
    with pytest.raises(InvalidValueError, match="dst"):
        backend.copy_2d_async(buf.ptr, 32, buf.ptr + 2048, 32, 16, 1 << 62, stream)
    _unchanged(backend, stream, buf)


@pytest.mark.parametrize("alloc", ["alloc_device", "alloc_pinned"])
@pytest.mark.parametrize("value", [1.5, 4096.0, "4096", None, True, 1 << 64], ids=repr)
def test_alloc_refuses_non_int_sizes(backend, alloc, value):
    with pytest.raises(InvalidValueError, match="nbytes"):
        getattr(backend, alloc)(value)


@pytest.mark.parametrize("bad", [
    pytest.param(lambda d, s, n: (d.astype(np.float64), s, n), id="float-dsts"),
    pytest.param(lambda d, s, n: (d, s, n.astype(np.float64) + 0.5), id="fractional-sizes"),
    pytest.param(lambda d, s, n: (d, s, -n.astype(np.float64)), id="negative-float-sizes"),
    pytest.param(lambda d, s, n: (d, s, -n.astype(np.int64)), id="negative-int-sizes"),
    pytest.param(lambda d, s, n: (d, s, n.astype(bool)), id="bool-sizes"),
    pytest.param(lambda d, s, n: ([1 << 64] * len(d), s, n), id="python-ints-beyond-u64"),
    pytest.param(lambda d, s, n: (list(d[:-1]) + [None], s, n), id="none-entry"),
])
def test_copy_batch_refuses_non_integer_arrays(backend, stream, buf, bad):
    dsts = np.uint64(buf.ptr) + np.array([0, 64], dtype=np.uint64)
    srcs = np.uint64(buf.ptr) + np.array([2048, 2112], dtype=np.uint64)
    sizes = np.array([16, 16], dtype=np.uint64)
    with pytest.raises(InvalidValueError, match="dsts|sizes"):
        backend.copy_batch_async(*bad(dsts, srcs, sizes), stream)
    _unchanged(backend, stream, buf)


@pytest.mark.parametrize("dst, nbytes", [
    pytest.param(lambda a: (1 << 64) - 1, lambda a: 2, id="address-plus-size-wraps"),
    pytest.param(lambda a: a.ptr, lambda a: (1 << 64) - a.ptr + 5, id="size-wraps-to-low"),
])
def test_copy_batch_wrapping_range_is_refused(backend, stream, buf, dst, nbytes):
    with pytest.raises(InvalidValueError, match=r"dsts\[0\]"):
        backend.copy_batch_async(np.array([dst(buf)], dtype=np.uint64),
                                 np.array([buf.ptr + 2048], dtype=np.uint64),
                                 np.array([nbytes(buf)], dtype=np.uint64), stream)
    _unchanged(backend, stream, buf)


def test_destroyed_stream_is_refused(backend, buf):
    stream = backend.create_stream()
    backend.destroy_stream(stream)
    event = backend.create_event()
    for use in (lambda: backend.copy_async(buf.ptr, buf.ptr + 2048, 16, stream),
                lambda: backend.record_event(event, stream),
                lambda: backend.stream_wait_event(stream, event),
                lambda: backend.stream_synchronize(stream),
                lambda: backend.destroy_stream(stream)):
        with pytest.raises(InvalidValueError):
            use()
    assert backend.event_query(event) is True  # never recorded, so never pending


def test_foreign_stream_and_event_objects_are_refused(backend, stream):
    event = backend.create_event()
    for use in (lambda: backend.stream_synchronize("stream"),
                lambda: backend.stream_synchronize(Stream("no-such-backend", 0, stream.handle)),
                lambda: backend.record_event(None, stream),
                lambda: backend.record_event(Event("no-such-backend", False, event.handle),
                                             stream),
                lambda: backend.event_elapsed_ms(1, 2)):
        with pytest.raises(InvalidValueError):
            use()


@pytest.mark.parametrize("device", [7, -1, 0.0, "0"], ids=repr)
def test_unknown_device_is_refused(backend, device):
    with pytest.raises(InvalidValueError, match="device"):
        backend.create_stream(device)
    with pytest.raises(InvalidValueError, match="device"):
        backend.alloc_device(64, device)


def test_free_refuses_what_is_not_an_allocation(backend):
    with pytest.raises(InvalidValueError, match="Allocation"):
        backend.free(42)


def test_register_host_refuses_unmapped_and_read_only_memory(backend):
    require(backend, "host_register")
    with pytest.raises(InvalidValueError, match="ptr"):
        backend.register_host(1.5, 4096)
    with pytest.raises(InvalidValueError):
        backend.register_host(mmap.PAGESIZE, 4096)  # below vm.mmap_min_addr: never mapped
    ro = mmap.mmap(-1, 1 << 16, prot=mmap.PROT_READ)
    ptr = np.frombuffer(ro, dtype=np.uint8).ctypes.data
    with pytest.raises(InvalidValueError, match="read-write"):
        backend.register_host(ptr, 1 << 16)
