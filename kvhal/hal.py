"""Device HAL: the contract every accelerator backend implements (DESIGN §2).

Units: sizes, offsets, pitches and widths are bytes (`int`); addresses are `int` (a flat
address space: device and host addresses are distinct values, as with CUDA/HIP unified
addressing); event times are milliseconds (`float`). All copies are stream-ordered and
asynchronous: their effects are observable only after a `stream_synchronize`, an
`event_synchronize` on an event recorded after them, or a `stream_wait_event` that orders another
stream behind them.

Threading: a backend object may be called from several threads at once; work submitted to one
stream runs in submission (FIFO) order; work on different streams is unordered unless joined by
`stream_wait_event`.

The HAL knows nothing about KV caches, layers or tiers.
"""
from __future__ import annotations

import ctypes
import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

#: Minimum alignment, in bytes, of every non-empty allocation (DESIGN §2).
MIN_ALIGNMENT = 256


class HalError(RuntimeError):
    """Base of every error a backend raises.

    Attributes:
        backend: Registered backend name (e.g. "cpu", "cuda").
        code: The vendor error code (e.g. a `cudaError_t` value), or None for kvhal's own checks.
        api: The API that failed (e.g. "cudaMemcpyAsync", "mmap"), or None.
    """

    def __init__(self, message: str, *, backend: str, code: int | None = None,
                 api: str | None = None):
        detail = ", ".join(p for p in (f"api={api}" if api else "",
                                       f"code={code}" if code is not None else "") if p)
        super().__init__(f"[{backend}] {message}" + (f" ({detail})" if detail else ""))
        self.backend = backend
        self.code = code
        self.api = api


class OutOfMemoryError(HalError):
    """An allocation could not be satisfied (device, pinned or registration limits)."""


class InvalidValueError(HalError):
    """An argument is invalid: unknown address range, pitch < width, mismatched arrays, ...

    Attributes:
        arg: The offending argument's name exactly as the `DeviceBackend` method spells its
            parameter ("nbytes", "dst", "src_pitch", "dsts", "copies", "allocation",
            "device", "ptr", "stream", "event", "start", ...), or None when no single argument
            is at fault. When several arguments are wrong, the first one checked is named. A
            range (a copy's span, a registered host range) that lies outside the live
            allocations, or does not fit in 64 bits, is blamed on its start address argument
            ("dst", "src", "ptr"; "dsts"/"srcs" in a batch). kvhal's argument helpers
            (`as_int`, `as_u64`, `as_copies_2d`) set it; the conformance suite checks it.
        index: For an array argument (`dsts`, `srcs`, `sizes`, the rows of `copies`), the
            position of the first offending entry or row, in the caller's numbering; else None.
    """

    def __init__(self, message: str, *, backend: str, arg: str | None = None,
                 index: int | None = None, code: int | None = None, api: str | None = None):
        super().__init__(message, backend=backend, code=code, api=api)
        self.arg = arg
        self.index = index


class NotSupportedError(HalError):
    """The backend does not implement this operation or memory kind."""


class BackendUnavailableError(HalError):
    """The backend cannot run here (no driver, no device, missing vendor library)."""


class DeviceFaultError(HalError):
    """The device reported a fault (illegal address, ECC, lost device); state is suspect."""


class MemoryKind(enum.Enum):
    """Where an allocation lives.

    DEVICE: accelerator memory (`alloc_device`). PINNED: page-locked host memory allocated by
    the backend (`alloc_pinned`). REGISTERED: existing host memory registered with the backend
    (`register_host`); `free` unregisters it and never releases the caller's memory.
    """

    DEVICE = "device"
    PINNED = "pinned"
    REGISTERED = "registered"


@dataclass(frozen=True, slots=True)
class Allocation:
    """A range of memory known to one backend.

    Attributes:
        ptr: Start address (0 for an empty allocation).
        nbytes: Exact size in bytes as requested (never rounded up).
        kind: Where it lives.
        device: Device ordinal for DEVICE memory; -1 for host memory.
        backend: Name of the backend that owns it.
        handle: Backend-private state (compare=False); opaque to callers.
    """

    ptr: int
    nbytes: int
    kind: MemoryKind
    device: int
    backend: str
    handle: Any = field(default=None, compare=False, repr=False)

    @property
    def end(self) -> int:
        """One past the last byte's address."""
        return self.ptr + self.nbytes


@dataclass(frozen=True, slots=True)
class Stream:
    """An ordered queue of asynchronous work on one device.

    Attributes:
        backend: Owning backend name.
        device: Device ordinal.
        handle: Backend-private stream object (e.g. a `cudaStream_t` value).
    """

    backend: str
    device: int
    handle: Any = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Event:
    """A marker recorded into a stream; completes when the stream reaches it.

    Attributes:
        backend: Owning backend name.
        timing: True if `event_elapsed_ms` may be called on it.
        handle: Backend-private event object.
    """

    backend: str
    timing: bool
    handle: Any = field(compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend really does on this machine (not what it would like to do).

    Attributes:
        name: Backend name.
        device_count: Number of usable devices.
        page_locked_host: True if `alloc_pinned` returns memory that is actually page-locked.
        native_batch: True if `copy_batch_async` is one runtime call per descriptor chunk
            (e.g. `cudaMemcpyBatchAsync`); False if it loops over single copies.
        max_batch_descriptors: Descriptors per native batch call; larger batches are chunked.
        native_copy_2d: True if `copy_2d_async` is one DMA/runtime call per 2D copy.
        event_timing: True if timing events are supported.
        host_register: True if `register_host` is supported.
        notes: Free text shown by `kvhal doctor` (versions, reasons for degraded features).
    """

    name: str
    device_count: int
    page_locked_host: bool
    native_batch: bool
    max_batch_descriptors: int
    native_copy_2d: bool
    event_timing: bool
    host_register: bool
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Availability:
    """Answer of `DeviceBackend.probe()`: whether the backend can run here, and why not."""

    available: bool
    reason: str = ""


@runtime_checkable
class DeviceBackend(Protocol):
    """The device HAL every backend implements (DESIGN §2).

    Construction acquires the runtime; it raises `BackendUnavailableError` if `probe()` says
    the backend cannot run here.

    Argument checking (every method): each size, address, pitch, width, height and device
    argument must be an `int` or numpy integer in [0, 2**64) (`as_int`; bool and float are
    refused), batch arrays must be integer arrays (`as_u64`), and streams/events must be live
    objects of this backend; anything else raises `InvalidValueError` at the call, before any
    work is queued.
    """

    name: ClassVar[str]

    # -- discovery ---------------------------------------------------------------------------
    @classmethod
    def probe(cls) -> Availability:
        """Whether the backend can run on this machine. Never raises; no side effects."""

    @classmethod
    def is_available(cls) -> bool:
        """`probe().available`. Never raises; no side effects."""

    def capabilities(self) -> Capabilities:
        """What this backend instance really supports (see `Capabilities`)."""

    # -- memory ------------------------------------------------------------------------------
    def alloc_device(self, nbytes: int, device: int = 0) -> Allocation:
        """Allocate `nbytes` (≥ 0) of device memory, aligned to ≥ `MIN_ALIGNMENT` bytes.

        Raises:
            InvalidValueError: nbytes < 0 or an unknown device ordinal.
            OutOfMemoryError: the device cannot satisfy the request.
        """

    def alloc_pinned(self, nbytes: int) -> Allocation:
        """Allocate `nbytes` (≥ 0) of host memory, page-locked where the OS allows.

        Whether it really is page-locked is `capabilities().page_locked_host`.

        Raises:
            InvalidValueError: nbytes < 0.
            OutOfMemoryError: the host cannot satisfy the request.
        """

    def register_host(self, ptr: int, nbytes: int) -> Allocation:
        """Make existing host memory [ptr, ptr + nbytes) a valid copy endpoint (and pin it).

        The caller keeps ownership; `free` only unregisters.

        Raises:
            InvalidValueError: ptr is 0 with nbytes > 0, or nbytes < 0, the range is not mapped
                read-write in this process, or it overlaps an existing registration.
            NotSupportedError: `capabilities().host_register` is False.
        """

    def free(self, allocation: Allocation) -> None:
        """Release an allocation (or unregister a REGISTERED one). Freeing twice raises.

        The caller must ensure no queued work still uses it (sync first).

        Raises:
            InvalidValueError: the allocation is unknown to this backend or already freed.
        """

    # -- streams and events ------------------------------------------------------------------
    def create_stream(self, device: int = 0) -> Stream:
        """Create a new non-blocking stream on `device`."""

    def destroy_stream(self, stream: Stream) -> None:
        """Wait for the stream's queued work, then release it.

        Raises:
            InvalidValueError: the stream was already destroyed; any later use of it raises too.
        """

    def stream_synchronize(self, stream: Stream) -> None:
        """Block until every operation submitted to `stream` so far has completed.

        Raises:
            DeviceFaultError: an operation on the stream failed asynchronously.
        """

    def stream_query(self, stream: Stream) -> bool:
        """True if all work submitted to `stream` so far has completed. Never blocks."""

    def stream_wait_event(self, stream: Stream, event: Event) -> None:
        """Make later work on `stream` wait until `event`'s most recent record completes.

        Waiting on a never-recorded event is a no-op (CUDA semantics). Does not block the host.
        """

    def create_event(self, timing: bool = False) -> Event:
        """Create an event; `timing=True` allows `event_elapsed_ms`."""

    def destroy_event(self, event: Event) -> None:
        """Release an event."""

    def record_event(self, event: Event, stream: Stream) -> None:
        """Record `event` at the current tail of `stream` (re-recording replaces the mark)."""

    def event_query(self, event: Event) -> bool:
        """True if the event's most recent record has completed (or it was never recorded)."""

    def event_synchronize(self, event: Event) -> None:
        """Block until the event's most recent record completes.

        Raises:
            DeviceFaultError: work before the event failed asynchronously.
        """

    def event_elapsed_ms(self, start: Event, end: Event) -> float:
        """Milliseconds between two completed timing events (≥ 0 when end follows start).

        Raises:
            InvalidValueError: either event lacks timing, was never recorded or has not completed.
        """

    # -- copies ------------------------------------------------------------------------------
    def copy_async(self, dst: int, src: int, nbytes: int, stream: Stream) -> None:
        """Copy `nbytes` from address `src` to `dst` in stream order (any direction).

        nbytes = 0 is a no-op. Ranges must lie inside allocations known to the backend.

        Raises:
            InvalidValueError: a range falls outside known allocations, or nbytes < 0.
        """

    def copy_2d_async(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int,
                      height: int, stream: Stream) -> None:
        """Copy `height` rows of `width` bytes; row i goes from src + i*src_pitch to
        dst + i*dst_pitch (`cudaMemcpy2DAsync` / `hipMemcpy2DAsync` semantics).

        width = 0 or height = 0 is a no-op.

        Raises:
            InvalidValueError: dst_pitch < width or src_pitch < width, negative values, or a
                range outside known allocations.
        """

    def copy_batch_async(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray,
                         stream: Stream) -> None:
        """Copy n independent ranges; no order among them. n = 0 is a no-op.

        Args:
            dsts, srcs, sizes: uint64 arrays of shape (n,): addresses and byte counts.

        Raises:
            InvalidValueError: arrays differ in length, are not 1-D, or a range is outside known
                allocations.
        """

    def copy_2d_batch_async(self, copies: np.ndarray, stream: Stream) -> None:
        """Issue n independent `copy_2d_async` copies at once; no order among them.

        Args:
            copies: integer array of shape (n, 6), one row per copy with the columns
                `COPY_2D_COLUMNS` = (dst, dst_pitch, src, src_pitch, width, height), in bytes
                (height in rows). n = 0 is a no-op; rows with width = 0 or height = 0 are
                no-ops.

        Every row is checked as `copy_2d_async` checks its arguments, for the whole batch
        before any copy is queued (`as_copies_2d`, then the backend's range checks).

        Raises:
            InvalidValueError: `copies` is not an (n, 6) integer array, has negative entries, a
                row has dst_pitch < width or src_pitch < width, or a row's range lies outside
                known allocations (the message names the row).
        """


def host_array(allocation: Allocation) -> np.ndarray:
    """A writable uint8 numpy view, shape (nbytes,), of a host (PINNED/REGISTERED) allocation.

    The view does not own the memory: it must not outlive `free(allocation)`.

    Raises:
        InvalidValueError: the allocation is device memory.
    """
    if allocation.kind is MemoryKind.DEVICE:
        raise InvalidValueError("host_array needs host memory, got a DEVICE allocation",
                                backend=allocation.backend, arg="allocation")
    return address_array(allocation.ptr, allocation.nbytes)


def address_array(ptr: int, nbytes: int) -> np.ndarray:
    """A writable uint8 numpy view, shape (nbytes,), of raw host memory at `ptr`.

    The caller guarantees the memory stays mapped while the view is used.
    """
    if nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


#: Largest value an address or byte count may take (they travel as uint64 to the runtime).
MAX_U64 = (1 << 64) - 1


def as_int(value: Any, what: str, backend: str) -> int:
    """`value` as a Python int in [0, 2**64), naming `what` in the error (its message and
    `InvalidValueError.arg`: pass the parameter's name).

    Accepts `int` and numpy integer scalars; refuses `bool`, floats (even integral ones),
    strings and None, so a bad argument fails at the call, never later on the stream.

    Raises:
        InvalidValueError: not an integer, negative, or ≥ 2**64.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InvalidValueError(f"{what} must be an int, got {type(value).__name__} "
                                f"{value!r}", backend=backend, arg=what)
    value = int(value)
    if not 0 <= value <= MAX_U64:
        raise InvalidValueError(f"{what} must be in [0, 2**64), got {value}", backend=backend,
                                arg=what)
    return value


def coalesce_batch(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, max_bytes: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Re-cut a batch into pieces of at most `max_bytes`: merge descriptors that continue one
    another, then split every merged range longer than `max_bytes`.

    Descriptor i+1 continues descriptor i when `dsts[i] + sizes[i] == dsts[i + 1]` and
    `srcs[i] + sizes[i] == srcs[i + 1]` (e.g. consecutive device blocks to consecutive bytes of
    a host slot). Each maximal run of continuing descriptors becomes one range, cut into
    `max_bytes` pieces from its start (the last piece holds the rest). The result moves exactly
    the same bytes; since `copy_batch_async` ranges are independent and unordered, a backend
    may issue it instead of the original.

    Args:
        dsts, srcs, sizes: uint64 arrays of shape (n,), addresses and byte counts (bytes),
            sizes > 0, ranges already checked (no sum wraps past 2**64).
        max_bytes: Largest piece (bytes, > 0).

    Returns:
        (dsts, srcs, sizes): uint64 arrays of shape (m,), in the original order; the inputs
        themselves when nothing merges and nothing is longer than `max_bytes`.
    """
    if len(sizes) == 0:
        return dsts, srcs, sizes
    head = sizes[:-1]
    joins = (dsts[:-1] + head == dsts[1:]) & (srcs[:-1] + head == srcs[1:])
    cap = np.uint64(max_bytes)
    if not joins.any() and int(sizes.max()) <= max_bytes:
        return dsts, srcs, sizes
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    dsts, srcs, sizes = dsts[starts], srcs[starts], np.add.reduceat(sizes, starts)
    pieces = ((sizes - np.uint64(1)) // cap + np.uint64(1)).astype(np.int64)
    run = np.repeat(np.arange(len(sizes)), pieces)
    first = np.repeat(np.cumsum(pieces) - pieces, pieces)
    offset = (np.arange(len(run)) - first).astype(np.uint64) * cap
    return (dsts[run] + offset, srcs[run] + offset,
            np.minimum(sizes[run] - offset, cap))


def as_u64(values: Any, what: str, backend: str) -> np.ndarray:
    """Coerce `values` to a contiguous 1-D uint64 array, naming `what` in the error (its
    message and `InvalidValueError.arg`, with `index` for a bad entry).

    Only integer inputs are accepted: a float, bool, string or object array (or a list that
    becomes one) is refused rather than truncated, so a batch never moves different bytes than
    the caller asked for.

    Raises:
        InvalidValueError: not 1-D, not integers, negative entries, or entries ≥ 2**64.
    """
    try:
        arr = np.asarray(values)
    except (OverflowError, ValueError) as exc:
        raise InvalidValueError(f"{what} is not an integer array: {exc}", backend=backend,
                                arg=what) from None
    if arr.ndim != 1:
        raise InvalidValueError(f"{what} must be 1-D, got shape {arr.shape}", backend=backend,
                                arg=what)
    if arr.dtype == np.uint64 or arr.size == 0:
        return np.ascontiguousarray(arr, dtype=np.uint64)
    if arr.dtype.kind not in "iu":
        raise InvalidValueError(f"{what} must hold integers, got dtype {arr.dtype}"
                                + (" (Python ints ≥ 2**64 or non-numbers?)"
                                   if arr.dtype == object else ""), backend=backend, arg=what)
    if arr.dtype.kind == "i" and arr.min() < 0:
        bad = int(np.flatnonzero(arr < 0)[0])
        raise InvalidValueError(f"{what}[{bad}] is negative: {int(arr[bad])}", backend=backend,
                                arg=what, index=bad)
    return np.ascontiguousarray(arr.astype(np.uint64))


#: Columns of a `copy_2d_batch_async` row, in order (all bytes, height in rows).
COPY_2D_COLUMNS = ("dst", "dst_pitch", "src", "src_pitch", "width", "height")


def as_copies_2d(copies: Any, backend: str, ranges: Any = None) -> np.ndarray:
    """Validate a `copy_2d_batch_async` argument; returns its non-empty rows.

    Args:
        copies: The argument (see `DeviceBackend.copy_2d_batch_async`).
        backend: Backend name for errors.
        ranges: Optional registry of live allocations with a vectorised
            `check_many(ptrs, sizes, what)` (e.g. the cpu backend's `RangeRegistry`); when
            given, every row's dst and src span (`copy_2d_spans`) is checked against it too.

    Returns:
        A C-contiguous uint64 array of shape (m, 6) (`COPY_2D_COLUMNS`): the rows with
        width > 0 and height > 0, in their original order, each with both pitches ≥ width and
        both spans `(height - 1) * pitch + width` below 2**64.

    Raises:
        InvalidValueError: not an integer array of shape (n, 6), a negative entry, a pitch
            smaller than the width, a span that does not fit in 64 bits, or (with `ranges`) a
            span outside the live allocations; `arg` is "copies" and `index` the offending
            row's number in `copies` (empty rows counted), None for a shape or type error.
    """
    def refuse(message: str, row: int | None = None) -> InvalidValueError:
        return InvalidValueError(message, backend=backend, arg="copies", index=row)

    try:
        arr = np.asarray(copies)
    except (OverflowError, ValueError) as exc:
        raise refuse(f"copies is not an integer array: {exc}") from None
    if arr.ndim != 2 or arr.shape[1] != len(COPY_2D_COLUMNS):
        raise refuse(f"copies must have shape (n, {len(COPY_2D_COLUMNS)}) with columns "
                     f"{COPY_2D_COLUMNS}, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty((0, len(COPY_2D_COLUMNS)), dtype=np.uint64)
    if arr.dtype != np.uint64:
        try:
            arr = as_u64(arr.ravel(), "copies", backend).reshape(arr.shape)
        except InvalidValueError as exc:
            row = None if exc.index is None else exc.index // len(COPY_2D_COLUMNS)
            raise refuse(str(exc).removeprefix(f"[{backend}] "), row) from None
    rows = np.ascontiguousarray(arr)
    width, height = rows[:, 4], rows[:, 5]
    keep = (width > 0) & (height > 0)
    numbers = None  # the caller's row number of each kept row (None: all kept)
    if not keep.all():
        numbers = np.flatnonzero(keep)
        rows = rows[keep]
        width, height = rows[:, 4], rows[:, 5]

    def number(kept: int) -> int:
        return kept if numbers is None else int(numbers[kept])

    for col in (1, 3):
        pitch = rows[:, col]
        short = pitch < width
        if short.any():
            bad = number(int(np.flatnonzero(short)[0]))
            raise refuse(f"copies row {bad}: {COPY_2D_COLUMNS[col]} {int(arr[bad, col])} < "
                         f"width {int(arr[bad, 4])}", bad)
        # (height - 1) * pitch + width must not wrap: pitch ≥ width > 0 here
        wraps = height - np.uint64(1) > (np.uint64(MAX_U64) - width) // pitch
        if wraps.any():
            bad = number(int(np.flatnonzero(wraps)[0]))
            raise refuse(f"copies row {bad}: {int(arr[bad, 5])} rows of "
                         f"{COPY_2D_COLUMNS[col]} {int(arr[bad, col])} from "
                         f"{COPY_2D_COLUMNS[col - 1]} span past 2**64", bad)
    if ranges is not None and len(rows):
        for col, span in zip((0, 2), copy_2d_spans(rows)):
            try:
                ranges.check_many(rows[:, col], span, f"copies {COPY_2D_COLUMNS[col]}")
            except InvalidValueError as exc:
                bad = None if exc.index is None else number(exc.index)
                raise refuse(f"copies row {bad}: {COPY_2D_COLUMNS[col]} range "
                             f"[{int(arr[bad, col]):#x}, +{int(span[exc.index])}) is outside "
                             "every allocation of this backend" if bad is not None
                             else str(exc).removeprefix(f"[{backend}] "), bad) from None
    return rows


def copy_2d_spans(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bytes each row of `as_copies_2d` touches from its dst and from its src:
    `(height - 1) * pitch + width`, two uint64 arrays of shape (m,)."""
    last = rows[:, 5] - np.uint64(1)
    return last * rows[:, 1] + rows[:, 4], last * rows[:, 3] + rows[:, 4]


def copy_2d_batch_by_loop(backend: DeviceBackend, copies: Any, stream: Stream) -> None:
    """`copy_2d_batch_async` as one `backend.copy_2d_async` per non-empty row: the shared
    default for backends without a batched 2D call.

    The whole batch's shape and pitches are checked first (`as_copies_2d`); each row's ranges
    are checked by its `copy_2d_async`, so a caller wanting all-or-nothing range checks runs
    `as_copies_2d(copies, name, ranges)` before calling this (as `RuntimeBackend` does).

    Raises:
        InvalidValueError: as `DeviceBackend.copy_2d_batch_async`.
    """
    copy = backend.copy_2d_async
    for dst, dst_pitch, src, src_pitch, width, height in \
            as_copies_2d(copies, backend.name).tolist():
        copy(dst, dst_pitch, src, src_pitch, width, height, stream)
