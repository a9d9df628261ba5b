"""The pinned host region: one allocation through the HAL, cut into fixed-size chunk slots.

Sizes are exact: the region is `capacity * slot_bytes` bytes, never rounded to a power of two.
A region is either private (`alloc_pinned`) or shared across processes through an anonymous
memory file (`memfd_create`) that every process maps and registers with its backend
(`register_host`), so several TP ranks of one node use the same bytes (DESIGN §5). Other
processes open it by `/proc/<creator pid>/fd/<fd>`; it is never linked into `/dev/shm` or any
other folder, so the kernel frees it once the creator has closed it and every attached process
has unmapped it, or they have died — SIGKILL included. Nothing can leak into `/dev/shm`.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
import os
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from kvhal.hal import Allocation, DeviceBackend, address_array

#: Slots are rounded up to this many bytes (the OS page size, DESIGN §5).
PAGE_BYTES = mmap.PAGESIZE

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class HostRegionError(ValueError):
    """The host region cannot be sized, created or attached; the message says which value."""


@dataclass(frozen=True, slots=True)
class HostGeometry:
    """How the host region is cut.

    Attributes:
        slot_bytes: Bytes per slot: the canonical chunk bytes rounded up to `PAGE_BYTES`, plus
            the tail a tier asked for (`host_geometry`'s `tail_bytes`), page-rounded too.
        chunk_nbytes: Payload bytes of one chunk (≤ slot_bytes).
        capacity: Number of slots: `cpu_bytes_to_use // slot_bytes`.
    """

    slot_bytes: int
    chunk_nbytes: int
    capacity: int

    @property
    def nbytes(self) -> int:
        """Exact region size in bytes: capacity * slot_bytes."""
        return self.capacity * self.slot_bytes


@dataclass(frozen=True, slots=True)
class HostLayout:
    """A host region cut into pools of slots, one per KV cache group, each slot sized to its
    group's chunk (no slot is padded to the largest group's chunk).

    Slot ids are global (`kvhal.host.SlotTable` with `capacities`): pool p holds slots
    `[first_slots[p], first_slots[p] + pools[p].capacity)` from byte `offsets[p]` of the region.

    Attributes:
        pools: One `HostGeometry` per pool.
        offsets: Byte offset of each pool in the region.
    """

    pools: tuple[HostGeometry, ...]
    offsets: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Exact region size in bytes: the sum of the pools' sizes."""
        return sum(p.nbytes for p in self.pools)

    @property
    def capacities(self) -> tuple[int, ...]:
        """Slots per pool."""
        return tuple(p.capacity for p in self.pools)

    @property
    def first_slots(self) -> tuple[int, ...]:
        """Global id of each pool's first slot."""
        caps = self.capacities
        return tuple(sum(caps[:p]) for p in range(len(caps)))

    def slot_span(self, slot: int) -> tuple[int, int]:
        """(byte offset in the region, payload bytes) of global slot `slot`.

        Raises:
            IndexError: `slot` is outside [0, total capacity).
        """
        for pool, first, offset in zip(self.pools, self.first_slots, self.offsets):
            if first <= slot < first + pool.capacity:
                return offset + (slot - first) * pool.slot_bytes, pool.chunk_nbytes
        raise IndexError(f"slot {slot} outside [0, {sum(self.capacities)})")


def host_layout(chunk_nbytes: tuple[int, ...], cpu_bytes_to_use: int,
                shares: tuple[float, ...] | None = None, tail_bytes: int = 0) -> HostLayout:
    """Cut a budget of `cpu_bytes_to_use` bytes into one pool per group, each slot the group's
    chunk bytes rounded up to `PAGE_BYTES` (never padded to another group's chunk), plus
    `tail_bytes` as in `host_geometry`.

    Slot counts follow `shares` (relative slot counts, one per group; None: all 1.0, equal
    counts): a pool of the largest share gets n slots, pool p `max(1, floor(n * shares[p] /
    max(shares)))`, with n the largest count whose pools fit the budget. Each share is taken
    as the nearest fraction of denominator ≤ 2**20 (so 0.3 is 3/10, not the float just below
    it). Bytes left over (less than the next n's extra slots, so less than one slot of every
    pool) stay unallocated: `nbytes ≤ cpu_bytes_to_use` always.

    Raises:
        HostRegionError: no pools, a chunk size ≤ 0, shares of another length or one that is
            not a finite number > 0 (named `shares[i]`), or a budget too small for one slot of
            every pool.
    """
    if not chunk_nbytes:
        raise HostRegionError("chunk_nbytes: no groups")
    shares = (1.0,) * len(chunk_nbytes) if shares is None else tuple(shares)
    if len(shares) != len(chunk_nbytes):
        raise HostRegionError(f"shares: {len(shares)} given for {len(chunk_nbytes)} groups")
    for i, share in enumerate(shares):
        if (isinstance(share, bool) or not isinstance(share, (int, float))
                or not math.isfinite(share) or share <= 0):
            raise HostRegionError(f"shares[{i}]: must be a finite number > 0, got {share!r}")
    slots = [host_geometry(n, 1 << 62, tail_bytes).slot_bytes for n in chunk_nbytes]
    top = max(shares)
    ratios = [Fraction(s / top).limit_denominator(1 << 20) for s in shares]

    def counts(n: int) -> list[int]:
        return [max(1, math.floor(n * r)) for r in ratios]

    def cost(n: int) -> int:
        return sum(c * s for c, s in zip(counts(n), slots))

    if cost(1) > cpu_bytes_to_use:
        raise HostRegionError(f"cpu_bytes_to_use={cpu_bytes_to_use} holds no slot of every "
                              f"group (slots of {', '.join(map(str, slots))} bytes)")
    lo, hi = 1, cpu_bytes_to_use // min(s for s, r in zip(slots, ratios) if r == 1) + 1
    while hi - lo > 1:          # cost is nondecreasing in n: the largest n that fits
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if cost(mid) <= cpu_bytes_to_use else (lo, mid)
    pools = tuple(HostGeometry(s, n, c) for s, n, c in zip(slots, chunk_nbytes, counts(lo)))
    offsets = tuple(sum(p.nbytes for p in pools[:i]) for i in range(len(pools)))
    return HostLayout(pools, offsets)


def host_geometry(chunk_nbytes: int, cpu_bytes_to_use: int, tail_bytes: int = 0
                  ) -> HostGeometry:
    """Size the region for chunks of `chunk_nbytes` within a budget of `cpu_bytes_to_use`,
    each slot keeping at least `tail_bytes` free after its page-rounded payload (what the
    configured tiers ask for: `kvhal.config.host_tail_bytes`; no copy ever touches them).

    Raises:
        HostRegionError: chunk_nbytes ≤ 0, tail_bytes < 0, or the budget holds no slot at all.
    """
    if chunk_nbytes <= 0:
        raise HostRegionError(f"chunk_nbytes must be > 0, got {chunk_nbytes}")
    if tail_bytes < 0:
        raise HostRegionError(f"tail_bytes must be >= 0, got {tail_bytes}")
    slot_bytes = (-(-chunk_nbytes // PAGE_BYTES) + -(-tail_bytes // PAGE_BYTES)) * PAGE_BYTES
    capacity = cpu_bytes_to_use // slot_bytes
    if capacity <= 0:
        raise HostRegionError(f"cpu_bytes_to_use={cpu_bytes_to_use} holds no slot of "
                              f"{slot_bytes} bytes (chunk {chunk_nbytes} bytes)")
    return HostGeometry(slot_bytes, chunk_nbytes, capacity)


class HostRegion:
    """One host region known to a backend. Create with `allocate`, `create_shared` or
    `attach_shared`; release with `close` (idempotent).

    Attributes:
        geometry: The slot geometry.
        allocation: The backend allocation (PINNED, or REGISTERED for shared regions).
        ptr: Base address; slot s starts at `ptr + s * slot_bytes`.
        array: Writable uint8 numpy view of the whole region, shape (nbytes,) (no copy).
        view: The same bytes as a writable memoryview (format "B"), handed to tiers.
        share_path: Path other processes pass to `attach_shared` (`/proc/<pid>/fd/<fd>` of the
            creator; valid while the creator holds the region open), or None if not shared.
    """

    def __init__(self, backend: DeviceBackend, geometry: HostGeometry | HostLayout,
                 allocation: Allocation, *, share_path: str | None = None, fd: int | None = None, mapped: bool = False):
        self.backend = backend
        self.geometry = geometry
        self.allocation = allocation
        self.ptr = allocation.ptr
        self.array = address_array(allocation.ptr, geometry.nbytes)
        self.view = memoryview(self.array)
        self.share_path = share_path
        self._fd = fd
        self._mapped = mapped
        self._closed = False

    @classmethod
    def allocate(cls, backend: DeviceBackend, geometry: HostGeometry) -> "HostRegion":
        """A private region from `backend.alloc_pinned(geometry.nbytes)` (exact size).

        Raises:
            kvhal.hal.OutOfMemoryError: the backend cannot allocate it.
        """
        return cls(backend, geometry, backend.alloc_pinned(geometry.nbytes))

    @classmethod
    def create_shared(cls, backend: DeviceBackend, geometry: HostGeometry | HostLayout,
                      name: str) -> "HostRegion":
        """Create an anonymous memory file of exactly `geometry.nbytes` (`memfd_create(name)`),
        map it shared and register it with `backend`; other processes attach by `share_path`.

        Args:
            name: Label shown in `/proc/<pid>/fd` as `/memfd:<name>` (no file is created).

        Raises:
            HostRegionError: the memory file cannot be created, sized or mapped (errno named).
        """
        try:
            fd = os.memfd_create(name, os.MFD_CLOEXEC)
        except OSError as exc:
            raise HostRegionError(f"cannot create shared region {name!r}: {exc}") from None
        try:
            os.ftruncate(fd, geometry.nbytes)
            return cls._map_and_register(backend, geometry, fd, f"/proc/{os.getpid()}/fd/{fd}",
                                         own_fd=True)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach_shared(cls, backend: DeviceBackend, share_path: str,
                      geometry: HostGeometry | HostLayout) -> "HostRegion":
        """Map a shared region another process created (its `share_path`) and register it here.

        Raises:
            HostRegionError: the path cannot be opened (creator gone or region closed) or the
                region's size differs from `geometry.nbytes`.
        """
        try:
            fd = os.open(share_path, os.O_RDWR)
        except OSError as exc:
            raise HostRegionError(f"cannot open shared region {share_path}: {exc}") from None
        try:
            size = os.fstat(fd).st_size
            if size != geometry.nbytes:
                raise HostRegionError(f"shared region {share_path} has {size} bytes, expected "
                                      f"{geometry.nbytes}")
            return cls._map_and_register(backend, geometry, fd, share_path, own_fd=False)
        finally:
            os.close(fd)

    @classmethod
    def _map_and_register(cls, backend: DeviceBackend, geometry: HostGeometry | HostLayout,
                          fd: int, share_path: str, *, own_fd: bool) -> "HostRegion":
        ptr = _map_shared(fd, geometry.nbytes, share_path)
        try:
            allocation = backend.register_host(ptr, geometry.nbytes)
        except Exception:
            _libc.munmap(ptr, geometry.nbytes)
            raise
        return cls(backend, geometry, allocation, share_path=share_path,
                   fd=fd if own_fd else None, mapped=True)

    def slot_array(self, slot: int) -> np.ndarray:
        """uint8 view of slot `slot`'s payload, shape (chunk_nbytes,) (no copy; one-pool
        `HostGeometry` regions)."""
        start = slot * self.geometry.slot_bytes
        return self.array[start:start + self.geometry.chunk_nbytes]

    def close(self) -> None:
        """Release the allocation (unregister + unmap for shared; the creator also closes the
        memory file, so no further process can attach).

        Close every tier and worker using the region first: `array` and `view` dangle after.
        """
        if self._closed:
            return
        self._closed = True
        self.backend.free(self.allocation)
        if self._mapped:
            _libc.munmap(self.ptr, self.geometry.nbytes)
        if self._fd is not None:
            os.close(self._fd)


def _map_shared(fd: int, nbytes: int, path: str) -> int:
    ptr = _libc.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if ptr is None or ptr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise HostRegionError(f"cannot map {nbytes} bytes of {path}: {os.strerror(err)}")
    return ptr
