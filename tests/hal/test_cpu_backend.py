"""cpu reference backend: chaos mode really reorders, bad addresses are refused, env config."""
from __future__ import annotations

import numpy as np
import pytest

from kvhal.backends.cpu import CHAOS_ENV, CpuBackend
from kvhal.hal import DeviceBackend, InvalidValueError, OutOfMemoryError, host_array


def _race(backend: CpuBackend, iterations: int, wait: bool) -> int:
    """Copy A: src_i → mid on stream a; copy B: mid → dst on stream b; count wrong results."""
    nbytes = 4096
    a, b = backend.create_stream(), backend.create_stream()
    event = backend.create_event()
    src, dst = backend.alloc_pinned(nbytes * iterations), backend.alloc_pinned(nbytes)
    mid = backend.alloc_device(nbytes)
    data = np.random.default_rng(0).integers(0, 256, src.nbytes, dtype=np.uint8)
    host_array(src)[:] = data
    wrong = 0
    for i in range(iterations):
        backend.copy_async(mid.ptr, src.ptr + i * nbytes, nbytes, a)
        backend.record_event(event, a)
        if wait:
            backend.stream_wait_event(b, event)
        backend.copy_async(dst.ptr, mid.ptr, nbytes, b)
        backend.stream_synchronize(b)
        backend.stream_synchronize(a)
        wrong += not np.array_equal(host_array(dst), data[i * nbytes:(i + 1) * nbytes])
    for s in (a, b):
        backend.destroy_stream(s)
    for m in (src, dst, mid):
        backend.free(m)
    return wrong


def test_chaos_without_event_wait_produces_wrong_bytes():
    """The ordering check of the conformance suite can fail: drop the wait and it does."""
    assert _race(CpuBackend(chaos_seed=7), iterations=1000, wait=False) > 0


def test_chaos_with_event_wait_is_always_correct():
    assert _race(CpuBackend(chaos_seed=7), iterations=1000, wait=True) == 0


def test_chaos_seed_from_environment(monkeypatch):
    monkeypatch.setenv(CHAOS_ENV, "42")
    assert CpuBackend().chaos_seed == 42


def test_bad_chaos_seed_names_the_variable(monkeypatch):
    monkeypatch.setenv(CHAOS_ENV, "abc")
    with pytest.raises(InvalidValueError, match=CHAOS_ENV):
        CpuBackend()


def test_satisfies_protocol():
    assert isinstance(CpuBackend(), DeviceBackend)


def test_copy_outside_allocations_is_refused_before_any_byte_moves():
    be = CpuBackend()
    buf = be.alloc_device(4096)
    stream = be.create_stream()
    with pytest.raises(InvalidValueError, match="src"):
        be.copy_async(buf.ptr, buf.ptr + 4000, 200, stream)  # src overruns by 104 bytes
    with pytest.raises(InvalidValueError, match=r"dsts\[1\]"):
        be.copy_batch_async(np.array([buf.ptr, 12345], dtype=np.uint64),
                            np.array([buf.ptr, buf.ptr], dtype=np.uint64),
                            np.array([8, 8], dtype=np.uint64), stream)
    be.destroy_stream(stream)
    be.free(buf)


def test_copy_into_freed_memory_is_refused():
    be = CpuBackend()
    a, b = be.alloc_device(4096), be.alloc_device(4096)
    be.free(b)
    stream = be.create_stream()
    with pytest.raises(InvalidValueError):
        be.copy_async(b.ptr, a.ptr, 16, stream)
    be.destroy_stream(stream)


def test_device_capacity_is_accounted_exactly():
    be = CpuBackend(device_bytes=3 * 4096)
    first = be.alloc_device(2 * 4096)
    with pytest.raises(OutOfMemoryError, match="4096 of 12288 bytes free"):
        be.alloc_device(2 * 4096)
    be.free(first)
    be.free(be.alloc_device(3 * 4096))


def test_failed_operation_surfaces_at_sync():
    from kvhal.hal import DeviceFaultError
    be = CpuBackend()
    stream = be.create_stream()
    stream.handle.submit(lambda: 1 / 0)  # inject a fault a real copy cannot produce on demand
    with pytest.raises(DeviceFaultError, match="ZeroDivisionError"):
        be.stream_synchronize(stream)
    be.stream_synchronize(stream)  # reported once
    be.destroy_stream(stream)


@pytest.mark.parametrize("kwargs, what", [
    ({"chaos_seed": 1.5}, "chaos_seed"), ({"chaos_seed": "7"}, "chaos_seed"),
    ({"device_bytes": "abc"}, "device_bytes"), ({"device_bytes": -5}, "device_bytes"),
])
def test_bad_constructor_arguments_name_the_argument(kwargs, what):
    with pytest.raises(InvalidValueError, match=what):
        CpuBackend(**kwargs)
