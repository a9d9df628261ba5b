"""Host memory for the cpu backend: anonymous mmap, mlock, and a range registry.

The registry is what turns a bad address into an `InvalidValueError` instead of a segfault:
every copy endpoint is checked against the live allocations before any byte moves.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading

import numpy as np

from kvhal.hal import InvalidValueError, OutOfMemoryError

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
PAGE_BYTES = mmap.PAGESIZE


def map_anonymous(nbytes: int, backend: str) -> int:
    """mmap `nbytes` (> 0) of zeroed private memory; returns its page-aligned address.

    Raises:
        OutOfMemoryError: the kernel refused the mapping (ENOMEM).
    """
    ptr = _libc.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE,
                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if ptr is None or ptr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OutOfMemoryError(f"cannot map {nbytes} bytes: {os.strerror(err)}",
                               backend=backend, code=err, api="mmap")
    return ptr


def unmap(ptr: int, nbytes: int) -> None:
    """munmap a range returned by `map_anonymous`."""
    _libc.munmap(ptr, nbytes)


def lock_pages(ptr: int, nbytes: int) -> bool:
    """mlock [ptr, ptr + nbytes); True if the pages are now locked in RAM."""
    return _libc.mlock(ptr, nbytes) == 0


def unlock_pages(ptr: int, nbytes: int) -> None:
    """munlock a range locked by `lock_pages`."""
    _libc.munlock(ptr, nbytes)


def unmapped_or_read_only(ptr: int, nbytes: int, maps: str = "/proc/self/maps") -> int | None:
    """The first address in [ptr, ptr + nbytes) (nbytes > 0) not mapped read-write in this
    process, or None if the whole range is. Format of `maps`: proc(5), "start-end perms ...".

    Where `maps` cannot be read (not Linux), returns None: the range cannot be checked.
    """
    try:
        with open(maps) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    cursor, end = ptr, ptr + nbytes
    for line in lines:
        span, perms = line.split(maxsplit=2)[:2]
        lo, hi = (int(x, 16) for x in span.split("-"))
        if hi <= cursor:
            continue
        if lo > cursor or not perms.startswith("rw"):
            return cursor
        cursor = hi
        if cursor >= end:
            return None
    return cursor


def probe_page_locking() -> bool:
    """True if this process may mlock at least 2 MiB (RLIMIT_MEMLOCK or CAP_IPC_LOCK)."""
    nbytes = 2 << 20
    ptr = map_anonymous(nbytes, "cpu")
    try:
        ok = lock_pages(ptr, nbytes)
        if ok:
            unlock_pages(ptr, nbytes)
        return ok
    finally:
        unmap(ptr, nbytes)


class RangeRegistry:
    """Live address ranges; validates copy endpoints. Thread-safe.

    Lookups use sorted numpy arrays of starts and ends, rebuilt on every add/remove (rare),
    so validating a batch of n ranges is one vectorised `searchsorted`.
    """

    def __init__(self, backend: str):
        self._backend = backend
        self._lock = threading.Lock()
        self._ranges: dict[int, int] = {}  # start -> end
        self._starts = np.empty(0, dtype=np.uint64)
        self._ends = np.empty(0, dtype=np.uint64)

    def add(self, start: int, nbytes: int) -> None:
        """Record [start, start + nbytes). Raises InvalidValueError on overlap."""
        with self._lock:
            end = start + nbytes
            i = int(np.searchsorted(self._starts, np.uint64(start), side="right"))
            if (i > 0 and int(self._ends[i - 1]) > start) or \
                    (i < len(self._starts) and int(self._starts[i]) < end):
                raise InvalidValueError(f"range [{start:#x}, {end:#x}) overlaps a live range",
                                        backend=self._backend)
            self._ranges[start] = end
            self._rebuild()

    def remove(self, start: int) -> None:
        """Forget the range starting at `start`. Raises InvalidValueError if unknown."""
        with self._lock:
            if self._ranges.pop(start, None) is None:
                raise InvalidValueError(f"address {start:#x} is not a live allocation "
                                        "(double free?)", backend=self._backend)
            self._rebuild()

    def _rebuild(self) -> None:
        starts = sorted(self._ranges)
        self._starts = np.array(starts, dtype=np.uint64)
        self._ends = np.array([self._ranges[s] for s in starts], dtype=np.uint64)

    def check(self, ptr: int, nbytes: int, what: str) -> None:
        """Raise InvalidValueError (`arg` = `what`, the start address's parameter name) unless
        [ptr, ptr + nbytes) lies inside one live range."""
        starts, ends = self._starts, self._ends
        i = int(np.searchsorted(starts, np.uint64(ptr), side="right")) - 1 if ptr >= 0 else -1
        if i < 0 or ptr + nbytes > int(ends[i]):
            raise InvalidValueError(f"{what} range [{ptr:#x}, +{nbytes}) is outside every "
                                    "allocation of this backend", backend=self._backend,
                                    arg=what)

    def starts_of(self, ptrs: np.ndarray) -> np.ndarray:
        """Start of the live range holding each address of the uint64 array `ptrs` (any shape;
        the addresses must have passed `check`/`check_many`); uint64, same shape."""
        starts = self._starts
        return starts[np.searchsorted(starts, ptrs, side="right") - 1]

    def check_many(self, ptrs: np.ndarray, sizes: np.ndarray, what: str) -> None:
        """Vectorised `check` for uint64 arrays of shape (n,); the error's `index` is the
        first range outside."""
        starts, ends = self._starts, self._ends
        idx = np.searchsorted(starts, ptrs, side="right").astype(np.int64) - 1
        ok = idx >= 0
        safe = np.where(ok, idx, 0)
        if len(ends):
            end = ends[safe]
            # `sizes <= end - ptrs` rather than `ptrs + sizes <= end`: the sum can wrap in uint64
            ok &= (ptrs <= end) & (sizes <= end - np.minimum(ptrs, end))
        else:
            ok &= sizes == 0
        if not bool(ok.all()):
            bad = int(np.flatnonzero(~ok)[0])
            raise InvalidValueError(f"{what}[{bad}] range [{int(ptrs[bad]):#x}, "
                                    f"+{int(sizes[bad])}) is outside every allocation of this "
                                    "backend", backend=self._backend, arg=what, index=bad)
