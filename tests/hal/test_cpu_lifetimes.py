"""cpu backend: freeing memory a queued copy still uses, and the chaos-mode plumbing."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from kvhal.backends.cpu import CpuBackend
from kvhal.hal import InvalidValueError, host_array


def test_free_waits_for_queued_work_like_cudafree():
    """A copy still queued when its memory is freed runs before the unmap (no segfault)."""
    be = CpuBackend()
    stream = be.create_stream()
    src, dst = be.alloc_pinned(1 << 20), be.alloc_pinned(1 << 20)
    host_array(src)[:] = 7
    gate = threading.Event()
    stream.handle.submit(gate.wait)  # inject a stall a real copy cannot produce on demand
    be.copy_async(dst.ptr, src.ptr, 1 << 20, stream)
    seen = []
    be.record_event(event := be.create_event(), stream)
    freer = threading.Thread(target=lambda: (be.free(src), seen.append(be.event_query(event))))
    freer.start()
    freer.join(0.5)
    assert freer.is_alive(), "free returned while a copy from the memory was still queued"
    gate.set()
    freer.join()
    assert seen == [True]
    assert np.all(host_array(dst) == 7)
    be.destroy_stream(stream)
    be.free(dst)


def test_record_on_a_stream_closed_meanwhile_leaves_the_event_as_it_was():
    """`record_event` racing `destroy_stream`: the stream check passed, then the stream closed.
    The refused record must not leave the event pointing at a mark that never completes."""
    be = CpuBackend()
    stream, event = be.create_stream(), be.create_event()
    be.record_event(event, stream)
    be.event_synchronize(event)
    before = event.handle.mark
    worker = stream.handle
    be.destroy_stream(stream)
    with pytest.raises(InvalidValueError, match="destroyed"):
        worker.record(event.handle)  # the step after the stream check, as the race runs it
    assert event.handle.mark is before
    assert be.event_query(event) is True
