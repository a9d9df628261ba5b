"""The cpu reference backend: the HAL's oracle, run by every test on every machine.

"Device" memory is anonymous host memory; pinned memory is the same, page-locked with mlock
where the OS allows (reported honestly in `capabilities()`). Each stream is a worker thread;
copies are `ctypes.memmove` (which releases the GIL) or numpy strided copies, so two streams
really run in parallel on two cores.
"""
from __future__ import annotations

import ctypes
import functools
import itertools
import os
import threading
from typing import ClassVar

import numpy as np

from kvhal.hal import (Allocation, Availability, Capabilities, Event, InvalidValueError,
                       MemoryKind, OutOfMemoryError, Stream, address_array, as_copies_2d, as_int,
                       coalesce_batch, DeviceFaultError)

from ..validate import batch_arrays, copy_2d_args, copy_args, host_range
from .memory import (PAGE_BYTES, RangeRegistry, lock_pages, map_anonymous, probe_page_locking,
                     unlock_pages, unmap)
from .streams import EventState, StreamWorker

#: Env var that turns chaos mode on with the given integer seed.
CHAOS_ENV = "KVHAL_CPU_CHAOS"
#: The loop-based batch has no descriptor limit; this is the size we chunk queue items at.
BATCH_CHUNK = 1 << 16
#: A batch is re-cut into memmoves of at most this many bytes (`coalesce_batch`): fewer calls
#: save ~1 µs of ctypes overhead each, and on the project machine (AMD EPYC, 2 cores, glibc 2.36)
#: larger copies are slower: the memcpy column of `kvhal bench copy --backend cpu --sizes 128KiB
#: 256KiB 512KiB 1MiB 2MiB 16MiB` read 19.3 / 20.9 / 23.5 / 18.4 / 18.1 / 19.8 GB/s.
MEMMOVE_PIECE_BYTES = 512 << 10


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class CpuBackend:
    """Reference `DeviceBackend` on plain host memory (see module docstring).

    Args:
        chaos_seed: Seed for chaos mode (random per-stream delays); None reads `KVHAL_CPU_CHAOS`
            from the environment, and chaos stays off if that is unset.
        device_bytes: Capacity of "device" memory in bytes; allocations beyond it raise
            `OutOfMemoryError`. Default: the machine's physical memory.

    Raises:
        InvalidValueError: `chaos_seed` (or `KVHAL_CPU_CHAOS`) is not an integer, or
            `device_bytes` is not an int in [0, 2**64).
    """

    name: ClassVar[str] = "cpu"

    def __init__(self, chaos_seed: int | None = None, device_bytes: int | None = None):
        if chaos_seed is None and os.environ.get(CHAOS_ENV):
            try:
                chaos_seed = int(os.environ[CHAOS_ENV])
            except ValueError:
                raise InvalidValueError(f"{CHAOS_ENV} must be an integer seed, got "
                                        f"{os.environ[CHAOS_ENV]!r}", backend=self.name) from None
        if chaos_seed is not None and (isinstance(chaos_seed, bool)
                                       or not isinstance(chaos_seed, (int, np.integer))):
            raise InvalidValueError(f"chaos_seed must be an int or None, got {chaos_seed!r}",
                                    backend=self.name)
        self.chaos_seed = None if chaos_seed is None else int(chaos_seed)
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        self.device_bytes = (total if device_bytes is None
                             else as_int(device_bytes, "device_bytes", self.name))
        self._device_used = 0
        self._lock = threading.Lock()
        self._ranges = RangeRegistry(self.name)
        self._allocs: dict[int, Allocation] = {}
        #: start -> uint8 numpy view of the whole live allocation, for `copy_2d_batch_async`
        self._views: dict[int, np.ndarray] = {}
        self._workers: set[StreamWorker] = set()  # live (not destroyed) streams
        self._stream_ids = itertools.count()
        self._page_locked = probe_page_locking()

    # -- discovery ---------------------------------------------------------------------------
    @classmethod
    def probe(cls) -> Availability:
        """Always available: it needs nothing but the host."""
        return Availability(True)

    @classmethod
    def is_available(cls) -> bool:
        """Always True."""
        return True

    def capabilities(self) -> Capabilities:
        """cpu capabilities; `page_locked_host` is the result of a real mlock probe."""
        notes = ["chaos mode seed=%d" % self.chaos_seed] if self.chaos_seed is not None else []
        if not self._page_locked:
            notes.append("mlock refused (RLIMIT_MEMLOCK); pinned memory is pageable")
        return Capabilities(name=self.name, device_count=1, page_locked_host=self._page_locked,
                            native_batch=False, max_batch_descriptors=BATCH_CHUNK,
                            native_copy_2d=True, event_timing=True, host_register=True,
                            notes=tuple(notes))

    # -- memory ------------------------------------------------------------------------------
    def _check_device(self, device: int) -> None:
        if as_int(device, "device", self.name) != 0:
            raise InvalidValueError(f"device {device} does not exist (cpu has device 0 only)",
                                    backend=self.name, arg="device")

    def _map(self, nbytes: int, kind: MemoryKind, device: int) -> Allocation:
        nbytes = as_int(nbytes, "nbytes", self.name)
        if nbytes == 0:
            return Allocation(0, 0, kind, device, self.name)
        mapped = _round_up(int(nbytes), PAGE_BYTES)
        if kind is MemoryKind.DEVICE:
            with self._lock:
                if self._device_used + mapped > self.device_bytes:
                    raise OutOfMemoryError(
                        f"device 0 has {self.device_bytes - self._device_used} of "
                        f"{self.device_bytes} bytes free, {nbytes} requested",
                        backend=self.name, api="alloc_device")
                self._device_used += mapped
        try:
            ptr = map_anonymous(mapped, self.name)
        except OutOfMemoryError:
            if kind is MemoryKind.DEVICE:
                with self._lock:
                    self._device_used -= mapped
            raise
        locked = kind is MemoryKind.PINNED and self._page_locked and lock_pages(ptr, mapped)
        alloc = Allocation(ptr, int(nbytes), kind, device, self.name, handle=(mapped, locked))
        self._ranges.add(ptr, int(nbytes))
        with self._lock:
            self._allocs[ptr] = alloc
            self._views[ptr] = address_array(ptr, int(nbytes))
        return alloc

    def alloc_device(self, nbytes: int, device: int = 0) -> Allocation:
        """See `DeviceBackend.alloc_device`; capacity is `device_bytes`, page-rounded."""
        self._check_device(device)
        return self._map(nbytes, MemoryKind.DEVICE, 0)

    def alloc_pinned(self, nbytes: int) -> Allocation:
        """See `DeviceBackend.alloc_pinned`: mmap + mlock where permitted."""
        return self._map(nbytes, MemoryKind.PINNED, -1)

    def register_host(self, ptr: int, nbytes: int) -> Allocation:
        """See `DeviceBackend.register_host`; pages are mlocked where permitted.

        Also raises `InvalidValueError` if [ptr, ptr + nbytes) is not mapped readable and
        writable in this process (as `cudaHostRegister` refuses an unmapped range), so a garbage
        address fails here instead of crashing a later copy.
        """
        ptr, nbytes = host_range(self.name, ptr, nbytes)
        if nbytes == 0:
            return Allocation(0, 0, MemoryKind.REGISTERED, -1, self.name)
        self._ranges.add(ptr, nbytes)
        locked = self._page_locked and lock_pages(ptr, nbytes)
        alloc = Allocation(ptr, nbytes, MemoryKind.REGISTERED, -1, self.name,
                           handle=(nbytes, locked))
        with self._lock:
            self._allocs[ptr] = alloc
            self._views[ptr] = address_array(ptr, nbytes)
        return alloc

    def free(self, allocation: Allocation) -> None:
        """See `DeviceBackend.free`.

        Like `cudaFree`, it first waits for the work already queued on every live stream of
        this backend, so a copy still in flight never touches unmapped memory.
        """
        if not isinstance(allocation, Allocation):
            raise InvalidValueError(f"free: expected an Allocation, got "
                                    f"{type(allocation).__name__} {allocation!r}",
                                    backend=self.name, arg="allocation")
        if allocation.nbytes == 0:
            return
        with self._lock:
            live = self._allocs.get(allocation.ptr)
            if live != allocation:
                raise InvalidValueError(f"free: {allocation.ptr:#x} is not a live allocation "
                                        "of this backend (double free?)", backend=self.name,
                                        arg="allocation")
            del self._allocs[allocation.ptr]
            workers = list(self._workers)
        for worker in workers:
            worker.synchronize()
        self._ranges.remove(allocation.ptr)
        with self._lock:
            del self._views[allocation.ptr]
        mapped, locked = live.handle
        if locked:
            unlock_pages(allocation.ptr, mapped)
        if live.kind is MemoryKind.REGISTERED:
            return
        unmap(allocation.ptr, mapped)
        if live.kind is MemoryKind.DEVICE:
            with self._lock:
                self._device_used -= mapped

    # -- streams and events ------------------------------------------------------------------
    def _worker(self, stream: Stream) -> StreamWorker:
        if not isinstance(stream, Stream) or stream.backend != self.name or \
                not isinstance(stream.handle, StreamWorker):
            raise InvalidValueError(f"not a cpu stream: {stream!r}", backend=self.name,
                                    arg="stream")
        if stream.handle not in self._workers:
            raise InvalidValueError(f"stream {stream.handle.name} was destroyed or belongs to "
                                    "another backend instance", backend=self.name, arg="stream")
        return stream.handle

    def _raise_async(self, worker: StreamWorker) -> None:
        if worker.error is not None:
            err, worker.error = worker.error, None
            raise DeviceFaultError(f"an operation on the stream failed: {err!r}",
                                   backend=self.name) from err

    def create_stream(self, device: int = 0) -> Stream:
        """See `DeviceBackend.create_stream`: starts one worker thread.

        Raises:
            InvalidValueError: `device` is not 0.
        """
        self._check_device(device)
        sid = next(self._stream_ids)
        seed = None if self.chaos_seed is None else self.chaos_seed * 1_000_003 + sid
        worker = StreamWorker(f"kvhal-cpu-stream-{sid}", seed, self.name)
        with self._lock:
            self._workers.add(worker)
        return Stream(self.name, 0, worker)

    def destroy_stream(self, stream: Stream) -> None:
        """See `DeviceBackend.destroy_stream`. Any later use of the stream (destroying it again
        included) raises `InvalidValueError`."""
        worker = self._worker(stream)
        with self._lock:
            self._workers.discard(worker)
        worker.close()

    def stream_synchronize(self, stream: Stream) -> None:
        """See `DeviceBackend.stream_synchronize`."""
        worker = self._worker(stream)
        worker.synchronize()
        self._raise_async(worker)

    def stream_query(self, stream: Stream) -> bool:
        """See `DeviceBackend.stream_query`."""
        return self._worker(stream).idle()

    def stream_wait_event(self, stream: Stream, event: Event) -> None:
        """See `DeviceBackend.stream_wait_event`."""
        worker, mark = self._worker(stream), self._event(event).mark
        if mark is not None:
            worker.wait_for(mark)

    def create_event(self, timing: bool = False) -> Event:
        """See `DeviceBackend.create_event`."""
        return Event(self.name, bool(timing), EventState())

    def destroy_event(self, event: Event) -> None:
        """See `DeviceBackend.destroy_event` (nothing to release on cpu)."""
        self._event(event)

    def _event(self, event: Event, what: str = "event") -> EventState:
        if not isinstance(event, Event) or event.backend != self.name or \
                not isinstance(event.handle, EventState):
            raise InvalidValueError(f"not a cpu event: {event!r}", backend=self.name, arg=what)
        return event.handle

    def record_event(self, event: Event, stream: Stream) -> None:
        """See `DeviceBackend.record_event`."""
        self._worker(stream).record(self._event(event))

    def event_query(self, event: Event) -> bool:
        """See `DeviceBackend.event_query`."""
        mark = self._event(event).mark
        return mark is None or mark.done.is_set()

    def event_synchronize(self, event: Event) -> None:
        """See `DeviceBackend.event_synchronize`."""
        mark = self._event(event).mark
        if mark is None:
            return
        mark.done.wait()
        if mark.error is not None:
            raise DeviceFaultError(f"work before the event failed: {mark.error!r}",
                                   backend=self.name) from mark.error

    def event_elapsed_ms(self, start: Event, end: Event) -> float:
        """See `DeviceBackend.event_elapsed_ms` (perf_counter clock)."""
        marks = []
        for which, ev in (("start", start), ("end", end)):
            mark = self._event(ev, which).mark
            if not ev.timing:
                raise InvalidValueError(f"{which} event was created without timing",
                                        backend=self.name, arg=which)
            if mark is None or not mark.done.is_set():
                raise InvalidValueError(f"{which} event has not completed", backend=self.name,
                                        arg=which)
            marks.append(mark)
        return (marks[1].time_ns - marks[0].time_ns) / 1e6

    # -- copies ------------------------------------------------------------------------------
    def copy_async(self, dst: int, src: int, nbytes: int, stream: Stream) -> None:
        """See `DeviceBackend.copy_async`."""
        worker = self._worker(stream)
        nbytes = copy_args(self.name, self._ranges, dst, src, nbytes)
        if nbytes == 0:
            return
        dst, src = int(dst), int(src)
        worker.submit(lambda: ctypes.memmove(dst, src, nbytes))

    def copy_2d_async(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int,
                      height: int, stream: Stream) -> None:
        """See `DeviceBackend.copy_2d_async`: one numpy strided copy."""
        worker = self._worker(stream)
        args = copy_2d_args(self.name, self._ranges, dst, dst_pitch, src, src_pitch, width,
                            height)
        if args is None:
            return
        dst, dst_pitch, src, src_pitch, width, height = args
        if dst_pitch == src_pitch == width:
            worker.submit(lambda: ctypes.memmove(dst, src, width * height))
            return

        def run() -> None:
            d = _strided(dst, dst_pitch, width, height)
            s = _strided(src, src_pitch, width, height)
            np.copyto(d, s)

        worker.submit(run)

    def copy_2d_batch_async(self, copies: np.ndarray, stream: Stream) -> None:
        """See `DeviceBackend.copy_2d_batch_async`: the whole batch is validated vectorised
        (`as_copies_2d` with the range registry), then queued as ONE stream operation that
        runs one numpy strided copy per row, on views made with `np.ndarray(...,
        buffer=<cached view of the allocation>, offset=, strides=)` (no ctypes per copy)."""
        worker = self._worker(stream)
        rows = as_copies_2d(copies, self.name, self._ranges)
        if not len(rows):
            return
        addrs = rows[:, [0, 2]]  # (m, 2): dst, src
        starts = self._ranges.starts_of(addrs)
        with self._lock:
            buffers = {start: self._views.get(start) for start in np.unique(starts).tolist()}
        if any(view is None for view in buffers.values()):
            raise InvalidValueError("copy_2d_batch_async: an allocation was freed while the "
                                    "batch was being issued", backend=self.name)
        # 8 flat lists of ints (not tracked by the garbage collector), not one list per copy:
        # a per-copy list or tuple makes the issuing thread trigger collections.
        work = np.concatenate([rows[:, [1, 3, 4, 5]], starts, addrs - starts], axis=1,
                              dtype=np.uint64).T.tolist()
        worker.submit(lambda: _copy_2d_all(work, buffers))

    def copy_batch_async(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray,
                         stream: Stream) -> None:
        """See `DeviceBackend.copy_batch_async`: the batch is re-cut into memmoves of at most
        `MEMMOVE_PIECE_BYTES` (descriptors that continue one another merged, longer ones split;
        `kvhal.hal.coalesce_batch`), then a memmove loop runs on the stream's thread (each
        ctypes.memmove releases the GIL)."""
        worker = self._worker(stream)
        d, s, n = batch_arrays(self.name, self._ranges, dsts, srcs, sizes)
        if len(n) == 0:
            return
        d, s, n = coalesce_batch(d, s, n, MEMMOVE_PIECE_BYTES)
        for lo in range(0, len(n), BATCH_CHUNK):
            triples = list(zip(d[lo:lo + BATCH_CHUNK].tolist(), s[lo:lo + BATCH_CHUNK].tolist(),
                               n[lo:lo + BATCH_CHUNK].tolist()))
            worker.submit(lambda t=triples: _memmove_all(t))


def _memmove_all(triples: list[tuple[int, int, int]]) -> None:
    move = ctypes.memmove
    for dst, src, nbytes in triples:
        move(dst, src, nbytes)


@functools.cache
def _row_dtype(width: int) -> np.dtype:
    """A raw-bytes numpy dtype of `width` bytes: one row of a 2D copy as one element."""
    return np.dtype((np.void, width))


def _copy_2d_all(work: list, buffers: dict[int, np.ndarray]) -> None:
    """Run validated 2D copies: `work` holds 8 equally long lists of ints, one entry per copy:
    dst_pitch, src_pitch, width, height, dst_start, src_start, dst_offset, src_offset (starts
    keying `buffers`).

    Each copy is one numpy assignment between two 1-D views of `height` elements of a
    `width`-byte void dtype (one element per row): on the project machine ~30% faster than
    (height, width) uint8 views for the vllm-cpu layout's 128-byte rows, measured with
    `kvhal bench copy2d`. numpy releases the GIL during each assignment."""
    view = np.ndarray
    for dst_pitch, src_pitch, width, height, dst_buf, src_buf, dst_off, src_off in zip(*work):
        row = _row_dtype(width)
        view((height,), row, buffers[dst_buf], dst_off, (dst_pitch,))[...] = \
            view((height,), row, buffers[src_buf], src_off, (src_pitch,))


def _strided(ptr: int, pitch: int, width: int, height: int) -> np.ndarray:
    span = (height - 1) * pitch + width
    flat = np.ctypeslib.as_array((ctypes.c_uint8 * span).from_address(ptr))
    return np.lib.stride_tricks.as_strided(flat, shape=(height, width), strides=(pitch, 1))
