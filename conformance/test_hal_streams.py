"""HAL conformance: stream and event semantics, and ordering across streams under chaos."""
from __future__ import annotations

import numpy as np
import pytest

from kvhal.hal import InvalidValueError, host_array

from .conftest import require
from .hal_helpers import reference_bytes

ITERATIONS = 1000


def test_sync_then_query_is_idle(backend):
    stream = backend.create_stream()
    buf = backend.alloc_device(1 << 20)
    try:
        backend.copy_async(buf.ptr, buf.ptr + (1 << 19), 1 << 19, stream)
        backend.stream_synchronize(stream)
        assert backend.stream_query(stream) is True
    finally:
        backend.destroy_stream(stream)
        backend.free(buf)


def test_event_completes_after_preceding_work(backend):
    stream = backend.create_stream()
    event = backend.create_event()
    src = backend.alloc_pinned(4 << 20)
    dst = backend.alloc_device(4 << 20)
    try:
        assert backend.event_query(event) is True  # never recorded
        backend.copy_async(dst.ptr, src.ptr, src.nbytes, stream)
        backend.record_event(event, stream)
        backend.event_synchronize(event)
        assert backend.event_query(event) is True
    finally:
        backend.destroy_event(event)
        backend.destroy_stream(stream)
        backend.free(src)
        backend.free(dst)


def test_elapsed_time_is_non_negative(backend):
    require(backend, "event_timing")
    stream = backend.create_stream()
    start, end = backend.create_event(timing=True), backend.create_event(timing=True)
    buf = backend.alloc_device(8 << 20)
    try:
        backend.record_event(start, stream)
        backend.copy_async(buf.ptr, buf.ptr + (4 << 20), 4 << 20, stream)
        backend.record_event(end, stream)
        backend.event_synchronize(end)
        assert backend.event_elapsed_ms(start, end) >= 0.0
    finally:
        backend.destroy_stream(stream)
        backend.free(buf)


def test_elapsed_time_without_timing_is_invalid(backend):
    stream = backend.create_stream()
    start, end = backend.create_event(), backend.create_event()
    try:
        backend.record_event(start, stream)
        backend.record_event(end, stream)
        backend.event_synchronize(end)
        with pytest.raises(InvalidValueError):
            backend.event_elapsed_ms(start, end)
    finally:
        backend.destroy_stream(stream)


def test_cross_stream_wait_orders_copies(chaos_backend):
    """A (host → device) then B (device → host) waiting on A's event always sees A's bytes."""
    be = chaos_backend
    nbytes = 64 << 10
    a, b = be.create_stream(), be.create_stream()
    event = be.create_event()
    src, dst = be.alloc_pinned(nbytes * ITERATIONS), be.alloc_pinned(nbytes)
    mid = be.alloc_device(nbytes)
    try:
        data = reference_bytes(src.nbytes, seed=3)
        host_array(src)[:] = data
        out = host_array(dst)
        wrong = 0
        for i in range(ITERATIONS):
            be.copy_async(mid.ptr, src.ptr + i * nbytes, nbytes, a)
            be.record_event(event, a)
            be.stream_wait_event(b, event)
            be.copy_async(dst.ptr, mid.ptr, nbytes, b)
            be.stream_synchronize(b)
            wrong += not np.array_equal(out, data[i * nbytes:(i + 1) * nbytes])
        assert wrong == 0
    finally:
        be.stream_synchronize(a)
        for s in (a, b):
            be.destroy_stream(s)
        for m in (src, dst, mid):
            be.free(m)
