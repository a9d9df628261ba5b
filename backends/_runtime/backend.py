"""`RuntimeBackend`: the one `DeviceBackend` implementation over a CUDA-style runtime API.

The cuda and rocm backends are this class with a `VendorTable` (names, error enum, batch
quirks). Every runtime call goes through `_call(op, ...)`, which maps the vendor's error code to
the HAL hierarchy. Copy endpoints are checked against the live allocations before any call, so
a bad address is an `InvalidValueError`, never a device fault.

Threading: the runtime's current device is per thread, so every call that creates something on
a device (`alloc_device`, `create_stream`, `create_event`) selects the device first.
"""
from __future__ import annotations

import threading
from typing import Any, ClassVar

import numpy as np

from kvhal.backends.cpu.memory import RangeRegistry
from kvhal.hal import (Allocation, Availability, BackendUnavailableError, Capabilities, Event,
                       HalError, InvalidValueError, MemoryKind, Stream, as_copies_2d,
                       as_int, copy_2d_batch_by_loop)

from .batch import chunk_bounds, select_batch_mode, uses_native
from .calls import binding_batch_call, ctypes_batch_call, load_ctypes_symbol
from .errors import Errors, code_of
from .probe import error_enum, import_binding, probe
from ..validate import batch_arrays, copy_2d_args, copy_args, host_range
from .vendor import CONSTANTS, OPERATIONS, VendorTable

#: `Allocation.handle` of device memory adopted with `adopt_device` (freed by its owner).
EXTERNAL = "external"


class RuntimeBackend:
    """`DeviceBackend` over a vendor runtime described by `table` (see module docstring).

    Args:
        device: Device selected for events and as the default of `alloc_device`/`create_stream`.

    Raises:
        BackendUnavailableError: `probe()` says the runtime cannot run here (its reason).
        InvalidValueError: `device` is not a valid ordinal.
    """

    name: ClassVar[str]
    table: ClassVar[VendorTable]

    # -- discovery ---------------------------------------------------------------------------
    @classmethod
    def probe(cls) -> Availability:
        """See `DeviceBackend.probe` and `probe.probe`. Never raises."""
        return probe(cls.table)

    @classmethod
    def is_available(cls) -> bool:
        """`probe().available`. Never raises."""
        return cls.probe().available

    def __init__(self, device: int = 0):
        availability = self.probe()
        if not availability.available:
            raise BackendUnavailableError(availability.reason, backend=self.name)
        self._bind()
        self._configure(device_count=int(self._call("get_device_count")),
                        runtime_version=int(self._call("runtime_version")),
                        driver_version=int(self._call("driver_version")), device=device)
        self._call("set_device", self.device)

    def _bind(self) -> None:
        """Resolve the binding's functions, constants and error enum (no runtime calls)."""
        table = self.table
        self._rt = rt = import_binding(table)
        self._errors = Errors(table, error_enum(table, rt))
        self._fn = {op: getattr(rt, table.api(op), None) for op in OPERATIONS}
        self._const = {key: getattr(rt, table.constant(key)) for key in CONSTANTS}
        kind_enum, kind_member = table.memcpy_kind()
        self._copy_kind = getattr(getattr(rt, kind_enum), kind_member)

    def _configure(self, device_count: int, runtime_version: int, driver_version: int,
                   device: int) -> None:
        """Set up state from what the runtime reported (no runtime calls)."""
        self.device_count = device_count
        self.device = self._check_device(device)
        self.runtime_version = runtime_version
        self.driver_version = driver_version
        self._batch_call, self.batch_mode = self._make_batch_call()
        self._lock = threading.Lock()
        self._allocs: dict[int, Allocation] = {}
        self._ranges = RangeRegistry(self.name)
        self._host_ranges = RangeRegistry(self.name)
        self._device_ranges = RangeRegistry(self.name)
        self._live_streams: dict[int, bool] = {}  # int(handle) -> created elsewhere
        self._live_events: set[int] = set()

    def _make_batch_call(self):
        table, quirks = self.table, self.table.batch
        if quirks.via_ctypes:
            symbol = load_ctypes_symbol(table)
            mode = select_batch_mode(table, self.runtime_version, self.driver_version,
                                     symbol is not None)
            call = ctypes_batch_call(symbol, table, self._errors, mode.fail_idx) \
                if mode.native else None
        else:
            mode = select_batch_mode(table, self.runtime_version, self.driver_version,
                                     self._fn["memcpy_batch_async"] is not None)
            call = binding_batch_call(self._rt, table, self._errors) if mode.native else None
        return call, mode

    def _call(self, op: str, *args: Any) -> Any:
        return self._errors.check(self._fn[op](*args), self.table.api(op))

    def _ready(self, op: str, handle: Any) -> bool:
        result = self._fn[op](handle)
        if code_of(result[0] if isinstance(result, tuple) else result) == self._errors.not_ready:
            return False
        self._errors.check(result, self.table.api(op))
        return True

    def _check_device(self, device: int) -> int:
        device = as_int(device, "device", self.name)
        if device >= self.device_count:
            raise InvalidValueError(f"device {device} does not exist ({self.device_count} "
                                    "device(s))", backend=self.name, arg="device")
        return device

    def capabilities(self) -> Capabilities:
        """See `DeviceBackend.capabilities`: versions and the batch path are in `notes`."""
        table = self.table
        notes = [f"runtime {table.version_text(self.runtime_version)}, driver "
                 f"{table.version_text(self.driver_version)}"]
        if self.batch_mode.native:
            notes.append(f"native {table.api('memcpy_batch_async')}, "
                         f"{self.batch_mode.max_descriptors} descriptors per call")
        else:
            notes.append(self.batch_mode.reason)
        return Capabilities(name=self.name, device_count=self.device_count,
                            page_locked_host=True, native_batch=self.batch_mode.native,
                            max_batch_descriptors=self.batch_mode.max_descriptors,
                            native_copy_2d=True, event_timing=True, host_register=True,
                            notes=tuple(notes))

    # -- memory ------------------------------------------------------------------------------
    def _track(self, alloc: Allocation) -> Allocation:
        self._ranges.add(alloc.ptr, alloc.nbytes)
        side = self._device_ranges if alloc.kind is MemoryKind.DEVICE else self._host_ranges
        side.add(alloc.ptr, alloc.nbytes)
        with self._lock:
            self._allocs[alloc.ptr] = alloc
        return alloc

    def alloc_device(self, nbytes: int, device: int | None = None) -> Allocation:
        """See `DeviceBackend.alloc_device` (`*Malloc`: 256-byte aligned, exact size)."""
        nbytes = as_int(nbytes, "nbytes", self.name)
        device = self.device if device is None else self._check_device(device)
        if nbytes == 0:
            return Allocation(0, 0, MemoryKind.DEVICE, device, self.name)
        self._call("set_device", device)
        ptr = int(self._call("malloc", nbytes))
        return self._track(Allocation(ptr, nbytes, MemoryKind.DEVICE, device, self.name))

    def alloc_pinned(self, nbytes: int) -> Allocation:
        """See `DeviceBackend.alloc_pinned` (`cudaHostAlloc`/`hipHostMalloc`, portable)."""
        nbytes = as_int(nbytes, "nbytes", self.name)
        if nbytes == 0:
            return Allocation(0, 0, MemoryKind.PINNED, -1, self.name)
        ptr = int(self._call("host_alloc", nbytes, self._const["host_alloc_portable"]))
        return self._track(Allocation(ptr, nbytes, MemoryKind.PINNED, -1, self.name))

    def register_host(self, ptr: int, nbytes: int) -> Allocation:
        """See `DeviceBackend.register_host` (`*HostRegister`, portable and mapped, so kernels
        reach it too): pins exactly [ptr, ptr + nbytes), no rounding of the region."""
        ptr, nbytes = host_range(self.name, ptr, nbytes)
        if nbytes == 0:
            return Allocation(0, 0, MemoryKind.REGISTERED, -1, self.name)
        alloc = self._track(Allocation(ptr, nbytes, MemoryKind.REGISTERED, -1, self.name))
        try:
            self._call("host_register", ptr, nbytes,
                       self._const["host_register_portable"] | self._const["host_register_mapped"])
        except HalError:
            self._forget(alloc)
            raise
        return alloc

    def adopt_device(self, ptr: int, nbytes: int, device: int) -> Allocation:
        """Make device memory allocated elsewhere (e.g. a torch KV cache tensor) a valid copy
        endpoint. `free` forgets it and never releases it.

        Raises:
            InvalidValueError: ptr is 0, nbytes ≤ 0, an unknown device, or overlap with a live
                range of this backend.
        """
        nbytes = as_int(nbytes, "nbytes", self.name)
        ptr = as_int(ptr, "ptr", self.name)
        if not ptr or nbytes == 0:
            raise InvalidValueError(f"adopt_device needs ptr ≠ 0 and nbytes > 0, got "
                                    f"ptr={ptr:#x} nbytes={nbytes}", backend=self.name,
                                    arg="nbytes" if ptr else "ptr")
        return self._track(Allocation(ptr, nbytes, MemoryKind.DEVICE,
                                      self._check_device(device), self.name, handle=EXTERNAL))

    def _forget(self, alloc: Allocation) -> None:
        if not isinstance(alloc, Allocation):
            raise InvalidValueError(f"free: expected an Allocation, got {alloc!r}",
                                    backend=self.name, arg="allocation")
        with self._lock:
            if self._allocs.get(alloc.ptr) != alloc:
                raise InvalidValueError(f"free: {alloc.ptr:#x} is not a live allocation of this "
                                        "backend (double free?)", backend=self.name,
                                        arg="allocation")
            del self._allocs[alloc.ptr]
        self._ranges.remove(alloc.ptr)
        side = self._device_ranges if alloc.kind is MemoryKind.DEVICE else self._host_ranges
        side.remove(alloc.ptr)

    def free(self, allocation: Allocation) -> None:
        """See `DeviceBackend.free` (`*Free`, `*FreeHost`/`hipHostFree`, `*HostUnregister`;
        the runtime waits for queued device work first)."""
        if isinstance(allocation, Allocation) and allocation.nbytes == 0:
            return
        self._forget(allocation)
        if allocation.handle == EXTERNAL:
            return
        op = {MemoryKind.DEVICE: "free", MemoryKind.PINNED: "free_host",
              MemoryKind.REGISTERED: "host_unregister"}[allocation.kind]
        self._call(op, allocation.ptr)

    # -- streams and events ------------------------------------------------------------------
    def _live(self, obj: Any, cls: type, live: Any, what: str | None = None) -> Any:
        """`obj.handle` if obj is a `cls` (Stream/Event) of this backend still in `live`;
        an error names the argument `what` (default: "stream" / "event")."""
        if not isinstance(obj, cls) or obj.backend != self.name or int(obj.handle) not in live:
            raise InvalidValueError(f"not a live {self.name} {cls.__name__.lower()} of this "
                                    f"backend (destroyed or foreign?): {obj!r}",
                                    backend=self.name, arg=what or cls.__name__.lower())
        return obj.handle

    def _stream(self, stream: Stream) -> Any:
        return self._live(stream, Stream, self._live_streams)

    def _event(self, event: Event, what: str = "event") -> Any:
        return self._live(event, Event, self._live_events, what)

    def create_stream(self, device: int | None = None) -> Stream:
        """See `DeviceBackend.create_stream` (non-blocking: never syncs with the legacy
        default stream)."""
        device = self.device if device is None else self._check_device(device)
        self._call("set_device", device)
        handle = self._call("stream_create", self._const["stream_non_blocking"])
        with self._lock:
            self._live_streams[int(handle)] = False
        return Stream(self.name, device, handle)

    def external_stream(self, handle: int, device: int) -> Stream:
        """Wrap a stream created elsewhere (e.g. torch's current stream) by its raw handle.

        The caller keeps ownership: do not `destroy_stream` it. Handle 0 is the legacy
        default stream; batches on it use the per-copy loop (see `batch.uses_native`).
        """
        device = self._check_device(device)
        handle = as_int(handle, "handle", self.name)
        with self._lock:
            self._live_streams[handle] = True
        stream_type = getattr(self._rt, self.table.prefix + "Stream_t")
        return Stream(self.name, device, stream_type(handle))

    def destroy_stream(self, stream: Stream) -> None:
        """See `DeviceBackend.destroy_stream`.

        Raises:
            InvalidValueError: the stream is not live, or came from `external_stream` (its
                owner destroys it).
        """
        handle = self._stream(stream)
        if self._live_streams[int(handle)]:
            raise InvalidValueError("destroy_stream: this stream was created elsewhere "
                                    "(external_stream); its owner destroys it", backend=self.name,
                                    arg="stream")
        with self._lock:
            del self._live_streams[int(handle)]
        self._call("stream_synchronize", handle)
        self._call("stream_destroy", handle)

    def stream_synchronize(self, stream: Stream) -> None:
        """See `DeviceBackend.stream_synchronize`; an async fault is a `DeviceFaultError`."""
        self._call("stream_synchronize", self._stream(stream))

    def stream_query(self, stream: Stream) -> bool:
        """See `DeviceBackend.stream_query` (not-ready is False, not an error)."""
        return self._ready("stream_query", self._stream(stream))

    def stream_wait_event(self, stream: Stream, event: Event) -> None:
        """See `DeviceBackend.stream_wait_event`."""
        self._call("stream_wait_event", self._stream(stream), self._event(event), 0)

    def create_event(self, timing: bool = False) -> Event:
        """See `DeviceBackend.create_event` (timing off uses `*EventDisableTiming`)."""
        self._call("set_device", self.device)
        flags = self._const["event_default" if timing else "event_disable_timing"]
        handle = self._call("event_create", flags)
        with self._lock:
            self._live_events.add(int(handle))
        return Event(self.name, bool(timing), handle)

    def destroy_event(self, event: Event) -> None:
        """See `DeviceBackend.destroy_event`; later use of the event raises
        `InvalidValueError`."""
        handle = self._event(event)
        with self._lock:
            self._live_events.discard(int(handle))
        self._call("event_destroy", handle)

    def record_event(self, event: Event, stream: Stream) -> None:
        """See `DeviceBackend.record_event`."""
        self._call("event_record", self._event(event), self._stream(stream))

    def event_query(self, event: Event) -> bool:
        """See `DeviceBackend.event_query`."""
        return self._ready("event_query", self._event(event))

    def event_synchronize(self, event: Event) -> None:
        """See `DeviceBackend.event_synchronize`."""
        self._call("event_synchronize", self._event(event))

    def event_elapsed_ms(self, start: Event, end: Event) -> float:
        """See `DeviceBackend.event_elapsed_ms` (`*EventElapsedTime`, ~0.5 µs resolution).

        Raises:
            InvalidValueError: an event lacks timing, was never recorded, or is not complete
                (the runtime's not-ready is reported as invalid here, per the HAL contract).
        """
        for which, ev in (("start", start), ("end", end)):
            self._event(ev, which)
            if not ev.timing:
                raise InvalidValueError(f"{which} event was created without timing",
                                        backend=self.name, arg=which)
        api = self.table.api("event_elapsed")
        result = self._fn["event_elapsed"](self._event(start), self._event(end))
        if code_of(result[0]) == self._errors.not_ready:
            raise InvalidValueError(f"{api}: an event has not completed", backend=self.name,
                                    code=self._errors.not_ready, api=api)
        return float(self._errors.check(result, api))

    # -- copies ------------------------------------------------------------------------------
    def copy_async(self, dst: int, src: int, nbytes: int, stream: Stream) -> None:
        """See `DeviceBackend.copy_async` (`*MemcpyAsync`, direction from the addresses)."""
        handle = self._stream(stream)
        nbytes = copy_args(self.name, self._ranges, dst, src, nbytes)
        if nbytes:
            self._call("memcpy_async", int(dst), int(src), nbytes, self._copy_kind, handle)

    def copy_2d_async(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int,
                      height: int, stream: Stream) -> None:
        """See `DeviceBackend.copy_2d_async`: one `*Memcpy2DAsync` call."""
        handle = self._stream(stream)
        args = copy_2d_args(self.name, self._ranges, dst, dst_pitch, src, src_pitch, width,
                            height)
        if args is not None:
            self._call("memcpy_2d_async", *args, self._copy_kind, handle)

    def copy_2d_batch_async(self, copies: np.ndarray, stream: Stream) -> None:
        """See `DeviceBackend.copy_2d_batch_async`: the whole batch is validated first
        (`kvhal.hal.as_copies_2d` with the live ranges), then one `*Memcpy2DAsync` per row
        (`kvhal.hal.copy_2d_batch_by_loop`; the runtimes have no batched 2D call)."""
        self._stream(stream)
        copy_2d_batch_by_loop(self, as_copies_2d(copies, self.name, self._ranges), stream)

    def _all_inside(self, ranges: RangeRegistry, ptrs: np.ndarray, sizes: np.ndarray) -> bool:
        try:
            ranges.check_many(ptrs, sizes, "")
        except InvalidValueError:
            return False
        return True

    def _batch_arrays(self, dsts: Any, srcs: Any, sizes: Any):
        """`validate.batch_arrays` against this backend's live allocations."""
        return batch_arrays(self.name, self._ranges, dsts, srcs, sizes)

    def copy_batch_async(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray,
                         stream: Stream) -> None:
        """See `DeviceBackend.copy_batch_async`: one native batch call per
        `capabilities().max_batch_descriptors` descriptors, or one `*MemcpyAsync` per copy
        (older runtimes, or the legacy default stream)."""
        handle = self._stream(stream)
        d, s, n = self._batch_arrays(dsts, srcs, sizes)
        if len(n) == 0:
            return
        if not uses_native(self.batch_mode, self.table, int(handle)):
            copy = self._fn["memcpy_async"]
            api = self.table.api("memcpy_async")
            for dst, src, nbytes in zip(d.tolist(), s.tolist(), n.tolist()):
                self._errors.check(copy(dst, src, nbytes, self._copy_kind, handle), api)
            return
        h2d_pinned = (self._all_inside(self._host_ranges, s, n)
                      and self._all_inside(self._device_ranges, d, n))
        for lo, hi in chunk_bounds(len(n), self.batch_mode.max_descriptors):
            self._batch_call(d[lo:hi], s[lo:hi], n[lo:hi], h2d_pinned, handle)
