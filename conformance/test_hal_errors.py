"""HAL conformance: bad arguments fail at the call with `InvalidValueError`, never later on the
stream, never as a crash and never as silently different bytes; the error names the offending
argument in `InvalidValueError.arg` (and the array entry or row in `index`)."""
from __future__ import annotations

import mmap

import numpy as np
import pytest

from kvhal.hal import Event, Stream

from .conftest import require
from .hal_helpers import read, reference_bytes, refused, write

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
    with refused(arg):
        backend.copy_async(args["dst"], args["src"], args["nbytes"], stream)
    _unchanged(backend, stream, buf)


@pytest.mark.parametrize("value", NOT_INTS, ids=repr)
@pytest.mark.parametrize("arg", ["dst_pitch", "src_pitch", "width", "height"])
def test_copy_2d_refuses_non_int_arguments(backend, stream, buf, arg, value):
    args = {"dst_pitch": 32, "src_pitch": 32, "width": 16, "height": 4} | {arg: value}
    with refused(arg):
        backend.copy_2d_async(buf.ptr, args["dst_pitch"], buf.ptr + 2048, args["src_pitch"],
                              args["width"], args["height"], stream)
    _unchanged(backend, stream, buf)


@pytest.mark.parametrize("side", ["dst", "src"])
def test_copy_2d_span_past_2_64_is_refused_naming_its_start(backend, stream, buf, side):
    """8 rows of a 2**62-byte pitch from one side span past 2**64; the other side's 8 rows of
    16 bytes lie inside `buf`. The error blames the wrapping range's start address."""
    pitch = {"dst": 16, "src": 16} | {side: 1 << 62}
    with refused(side):
        backend.copy_2d_async(buf.ptr, pitch["dst"], buf.ptr + 2048, pitch["src"], 16, 8,
                              stream)
    _unchanged(backend, stream, buf)


def test_copy_2d_huge_height_is_refused(backend, stream, buf):
    with refused({"dst", "src"}):  # both spans wrap: either start may be named first
        backend.copy_2d_async(buf.ptr, 32, buf.ptr + 2048, 32, 16, 1 << 62, stream)
    _unchanged(backend, stream, buf)


@pytest.mark.parametrize("alloc", ["alloc_device", "alloc_pinned"])
@pytest.mark.parametrize("value", [1.5, 4096.0, "4096", None, True, 1 << 64], ids=repr)
def test_alloc_refuses_non_int_sizes(backend, alloc, value):
    with refused("nbytes"):
        getattr(backend, alloc)(value)


@pytest.mark.parametrize("bad, arg", [
    pytest.param(lambda d, s, n: (d.astype(np.float64), s, n), "dsts", id="float-dsts"),
    pytest.param(lambda d, s, n: (d, s, n.astype(np.float64) + 0.5), "sizes",
                 id="fractional-sizes"),
    pytest.param(lambda d, s, n: (d, s, -n.astype(np.float64)), "sizes",
                 id="negative-float-sizes"),
    pytest.param(lambda d, s, n: (d, s, -n.astype(np.int64)), "sizes", id="negative-int-sizes"),
    pytest.param(lambda d, s, n: (d, s, n.astype(bool)), "sizes", id="bool-sizes"),
    pytest.param(lambda d, s, n: ([1 << 64] * len(d), s, n), "dsts",
                 id="python-ints-beyond-u64"),
    pytest.param(lambda d, s, n: (list(d[:-1]) + [None], s, n), "dsts", id="none-entry"),
    pytest.param(lambda d, s, n: (d, s[:1], n), "srcs", id="srcs-shorter"),
    pytest.param(lambda d, s, n: (d, s.astype(np.float32), n), "srcs", id="float-srcs"),
])
def test_copy_batch_refuses_non_integer_arrays(backend, stream, buf, bad, arg):
    dsts = np.uint64(buf.ptr) + np.array([0, 64], dtype=np.uint64)
    srcs = np.uint64(buf.ptr) + np.array([2048, 2112], dtype=np.uint64)
    sizes = np.array([16, 16], dtype=np.uint64)
    with refused(arg):
        backend.copy_batch_async(*bad(dsts, srcs, sizes), stream)
    _unchanged(backend, stream, buf)


@pytest.mark.parametrize("dst, nbytes", [
    pytest.param(lambda a: (1 << 64) - 1, lambda a: 2, id="address-plus-size-wraps"),
    pytest.param(lambda a: a.ptr, lambda a: (1 << 64) - a.ptr + 5, id="size-wraps-to-low"),
])
def test_copy_batch_wrapping_range_is_refused(backend, stream, buf, dst, nbytes):
    with refused("dsts", index=0):
        backend.copy_batch_async(np.array([dst(buf)], dtype=np.uint64),
                                 np.array([buf.ptr + 2048], dtype=np.uint64),
                                 np.array([nbytes(buf)], dtype=np.uint64), stream)
    _unchanged(backend, stream, buf)


@pytest.mark.parametrize("side, index", [("dsts", 1), ("srcs", 2)])
def test_copy_batch_range_outside_allocations_names_the_entry(backend, stream, buf, side,
                                                              index):
    addrs = {"dsts": np.uint64(buf.ptr) + np.array([0, 64, 128], dtype=np.uint64),
             "srcs": np.uint64(buf.ptr) + np.array([2048, 2112, 2176], dtype=np.uint64)}
    addrs[side][index] = buf.ptr + 4096 - 8   # 16 bytes from here run past the end of buf
    with refused(side, index=index):
        backend.copy_batch_async(addrs["dsts"], addrs["srcs"],
                                 np.array([16, 16, 16], dtype=np.uint64), stream)
    _unchanged(backend, stream, buf)


def test_copy_2d_batch_names_the_offending_row(backend, stream, buf):
    """Row numbers count every row of `copies`, empty rows (width or height 0) included."""
    ok = [buf.ptr, 32, buf.ptr + 2048, 32, 16, 4]
    empty = [0, 0, 0, 0, 0, 0]
    for bad_row, expected_row in (([buf.ptr, 8, buf.ptr + 2048, 32, 16, 4], 2),     # pitch
                                  ([buf.ptr + 4000, 32, buf.ptr + 2048, 32, 16, 4], 2),  # range
                                  ([buf.ptr, 1 << 62, buf.ptr + 2048, 32, 16, 8], 2)):   # wraps
        with refused("copies", index=expected_row):
            backend.copy_2d_batch_async(np.array([ok, empty, bad_row, ok], dtype=np.uint64),
                                        stream)
    with refused("copies", index=1):
        backend.copy_2d_batch_async(np.array([ok, [-1, 32, 0, 32, 16, 4]], dtype=np.int64),
                                    stream)
    with refused("copies"):
        backend.copy_2d_batch_async(np.zeros((2, 5), dtype=np.uint64), stream)
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
        with refused("stream"):
            use()
    assert backend.event_query(event) is True  # never recorded, so never pending


def test_foreign_stream_and_event_objects_are_refused(backend, stream):
    event = backend.create_event()
    started = backend.create_event(timing=True)
    backend.record_event(started, stream)
    backend.stream_synchronize(stream)
    for arg, use in (
            ("stream", lambda: backend.stream_synchronize("stream")),
            ("stream", lambda: backend.stream_synchronize(Stream("no-such-backend", 0,
                                                                 stream.handle))),
            ("event", lambda: backend.record_event(None, stream)),
            ("event", lambda: backend.record_event(Event("no-such-backend", False,
                                                         event.handle), stream)),
            ("start", lambda: backend.event_elapsed_ms(1, 2)),
            ("end", lambda: backend.event_elapsed_ms(started, 2))):
        with refused(arg):
            use()


@pytest.mark.parametrize("device", [7, -1, 0.0, "0"], ids=repr)
def test_unknown_device_is_refused(backend, device):
    with refused("device"):
        backend.create_stream(device)
    with refused("device"):
        backend.alloc_device(64, device)


def test_free_refuses_what_is_not_an_allocation(backend):
    with refused("allocation"):
        backend.free(42)


def test_register_host_refuses_unmapped_and_read_only_memory(backend):
    require(backend, "host_register")
    with refused("ptr"):
        backend.register_host(1.5, 4096)
    with refused("ptr"):
        backend.register_host(mmap.PAGESIZE, 4096)  # below vm.mmap_min_addr: never mapped
    ro = mmap.mmap(-1, 1 << 16, prot=mmap.PROT_READ)
    ptr = np.frombuffer(ro, dtype=np.uint8).ctypes.data
    with refused("ptr"):
        backend.register_host(ptr, 1 << 16)
