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


def test_event_completes_after_preceding_work(chaos_backend):
    """Once `event_synchronize` returns, the copies recorded before the event are done: the
    host reads the destination's final bytes (host → device → host on one stream, each round
    with new source bytes, under chaos delays).

    Fails when `event_synchronize` (or `record_event`) does not wait for the stream's earlier
    work: e.g. with `mark.done.wait()` removed from the cpu backend's `event_synchronize`, the
    destination still holds the previous round's bytes.
    """
    be = chaos_backend
    nbytes, rounds = 256 << 10, 50
    stream = be.create_stream()
    event = be.create_event()
    src, dst = be.alloc_pinned(nbytes * rounds), be.alloc_pinned(nbytes)
    mid = be.alloc_device(nbytes)
    try:
        assert be.event_query(event) is True  # never recorded
        data = reference_bytes(src.nbytes, seed=5)
        host_array(src)[:] = data
        out = host_array(dst)
        wrong = not_done = 0
        for i in range(rounds):
            be.copy_async(mid.ptr, src.ptr + i * nbytes, nbytes, stream)
            be.copy_async(dst.ptr, mid.ptr, nbytes, stream)
            be.record_event(event, stream)
            be.event_synchronize(event)
            wrong += not np.array_equal(out, data[i * nbytes:(i + 1) * nbytes])
            not_done += be.event_query(event) is not True
        assert (wrong, not_done) == (0, 0)
    finally:
        be.stream_synchronize(stream)
        be.destroy_event(event)
        be.destroy_stream(stream)
        for m in (src, dst, mid):
            be.free(m)


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
