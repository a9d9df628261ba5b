"""The fs tier's usage ledger: `max_bytes` holds for a namespace folder that processes share.

Each process indexes the chunks it knows of (`kvhal.tiers.index.ChunkIndex`) and learns of
other processes' files only at its next refresh; had each evicted against its own view, N
processes sharing one namespace folder (same `root_dir`, same model) would fill N times the
room. So every change of the namespace's chunk-file bytes is counted in one small file beside
its chunk folders, `<namespace>/usage` (little-endian u64 fields):

    offset 0    magic b"kvhalUS1"
    offset 8    total: bytes of the chunk files (`*.kv`) plus the reservations of stores in
                flight, in every process
    offset 16   committed: bytes of the stores that finished (a running sum, 2**64 bytes
                before it wraps; only its change while a refresh lists the folder matters,
                see `rebase`)
    offset 64   `SLOTS` slots of 16 bytes, one per open ledger (one per tier instance): at +8
                the bytes its stores in flight hold

Under the ledger's lock a store reserves: it reads the total, takes away a file already under
its chunk's name (another process's copy: its rename would replace it uncounted), and while
total + its bytes exceed the budget evicts this process's least recently used chunks, each
file it removes freeing its bytes (`Usage.free`) and one another process removed first
freeing nothing; then it adds its bytes to the total and to its slot (`Usage.reserve`). A
finished store moves them from its slot to `committed` (`commit`, total unchanged), a failed
one takes them off both (`release`). A file a store recycles (`recycle_files`) is renamed
away under the lock: its bytes pass from the chunk files to that store's reservation.

The total never falls below the bytes on disk: every race errs upwards, costing room, never
the budget. It exceeds them when two processes store the same chunk at once (the second
rename replaces the first file: counted twice), when a process was killed (-9) with stores
in flight (their reservations stay), and when something else removed files (`kvhal fsck
--repair`, a person). Every refresh of every tier sets it right (`rebase`): the bytes its
listing found, plus the reservations of live slots, plus what was committed while it listed,
less its own stores (in flight or committed meanwhile) whose files the listing found
(another process's store that finished meanwhile, or was renamed into place before it
commits, may or may not be in the listing: counted once more rather than missed, until the
next rescan); the slots of dead owners are freed there. A folder written by an
older kvhal (no ledger) is counted by a listing when the first tier creates the ledger, and
so is one whose ledger is damaged (then the reservations of stores in flight elsewhere are
lost: a damaged ledger is a fault).

Locks are Linux open-file-description locks (`F_OFD_SETLK`): byte 0 is the ledger's lock; a
tier holds byte 64 + 16·slot while open, and the kernel drops it when its process dies however
it dies, so a slot whose byte can be locked has no live owner (no pids, which other pid
namespaces would not show). Two ledgers in one process exclude each other as two processes
do; threads of one ledger share one lock and a `threading.Lock`. A child forked while a ledger
is open shares its locks (the ledger file is closed on exec): it must not use the parent's
tier, and the parent's slot counts as live while the child lives.

Assumed of the filesystem: POSIX byte-range locks that every process sharing the folder sees
(local filesystems; NFSv4, and NFSv3 with lockd, carry OFD locks to the server as POSIX locks,
so processes on several hosts coordinate; with `nolock` mounts only processes on one host do,
and a client that loses its lease loses its locks). Where locking fails (`ENOLCK`,
`EOPNOTSUPP`) the tier does not start. Not `flock`: it locks whole files only (no liveness per
slot), and on NFS Linux emulates it with a whole-file POSIX lock, which would conflict with
the slots' byte locks. Cost per store: two lock sections of a few system calls each, 15 µs
uncontended on a loaded 2-core machine (README, "Serving with vLLM").
"""
from __future__ import annotations

import errno
import fcntl
import os
import struct
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Container, Hashable, Iterator

#: Name of the ledger file inside a namespace folder.
USAGE_FILE = "usage"
MAGIC = b"kvhalUS1"
#: Ledgers open on one namespace at once (tier instances, in all processes): as many as
#: make the file one 4 KiB block.
SLOTS = 252
_HEADER = struct.Struct("<8sQQ")          # magic, total, committed
_COUNTS = struct.Struct("<QQ")            # total, committed (at offset 8)
_U64 = struct.Struct("<Q")
_SLOT0, _SLOT_BYTES = 64, 16
FILE_BYTES = _SLOT0 + SLOTS * _SLOT_BYTES
#: `struct flock` of Linux on 64-bit machines: l_type, l_whence, l_start, l_len, l_pid.
_FLOCK = struct.Struct("hhqqi4x")


def _lock(fd: int, kind: int, start: int, wait: bool) -> bool:
    """Set (`kind` F_WRLCK) or clear (F_UNLCK) this description's lock on byte `start`; with
    `wait` block until granted, else False if another description holds it. Raises OSError."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK,
                    _FLOCK.pack(kind, os.SEEK_SET, start, 1, 0))
    except OSError as exc:
        if not wait and exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _slot_at(slot: int) -> int:
    return _SLOT0 + slot * _SLOT_BYTES


@dataclass(slots=True)
class Usage:
    """The namespace's usage while the ledger's lock is held (`Ledger.locked`).

    Attributes:
        total: Bytes of the chunk files plus reservations in flight (all processes).
        reserved: Stores this section reserved, (file name, bytes).
    """

    total: int
    reserved: list[tuple[Hashable, int]] = field(default_factory=list)

    def free(self, nbytes: int) -> None:
        """Count `nbytes` of chunk files as gone: call only after removing (unlinking,
        renaming away) a file succeeded, with that file's size."""
        self.total = max(0, self.total - nbytes)

    def reserve(self, nbytes: int, name: Hashable) -> None:
        """Count a store's `nbytes` (its file's bytes; `name` names the file as the listings
        passed to `Ledger.rebase` do), until `Ledger.commit` or `Ledger.release`."""
        self.total += nbytes
        self.reserved.append((name, nbytes))


@dataclass(frozen=True, slots=True)
class UsageSnapshot:
    """What a ledger file holds (`read_usage`).

    Attributes:
        total: Bytes of the chunk files plus reservations in flight.
        committed: The running sum of finished stores' bytes.
        pending: Bytes reserved by stores in flight, summed over every slot (dead ones too).
    """

    total: int
    committed: int
    pending: int


class Ledger:
    """One tier's handle on the usage ledger of its namespace folder (module docstring).

    Args:
        ns_dir: The namespace folder.
        chunk_bytes: Bytes of the folder's chunk files now (a listing): called, under the
            lock, only when the ledger file is created or found damaged.

    Raises:
        OSError: the file cannot be created, read, written or locked (ENOLCK, EOPNOTSUPP:
            the filesystem has no byte-range locks), or every slot is held by a live ledger
            (EUSERS); the caller names root_dir.

    Thread-safe.
    """

    def __init__(self, ns_dir: str, chunk_bytes: Callable[[], int]):
        self.path = os.path.join(ns_dir, USAGE_FILE)
        self._mutex = threading.Lock()
        self._pending = 0
        #: This ledger's stores in flight: file name → bytes of each.
        self._in_flight: dict[Hashable, list[int]] = {}
        self._slot = -1
        #: This ledger's commits since `mark`, (file name, bytes); None outside a listing.
        self._window: list[tuple[Hashable, int]] | None = None
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            with self._mutex:
                _lock(self._fd, fcntl.F_WRLCK, 0, True)
                try:
                    if self._damaged():
                        self._create(chunk_bytes())
                    self._slot = self._claim_slot()
                finally:
                    _lock(self._fd, fcntl.F_UNLCK, 0, True)
        except BaseException:
            os.close(self._fd)
            raise

    def _damaged(self) -> bool:
        head = os.pread(self._fd, _HEADER.size, 0)
        return (len(head) < _HEADER.size or _HEADER.unpack(head)[0] != MAGIC
                or os.fstat(self._fd).st_size < FILE_BYTES)

    def _create(self, total: int) -> None:
        data = bytearray(FILE_BYTES)
        _HEADER.pack_into(data, 0, MAGIC, total, 0)
        os.pwrite(self._fd, data, 0)

    def _claim_slot(self) -> int:
        """Lock the first slot no live ledger holds; a dead owner's reservation is dropped
        from its slot (the total keeps it until the next `rebase`). Raises OSError(EUSERS)."""
        for slot in range(SLOTS):
            if _lock(self._fd, fcntl.F_WRLCK, _slot_at(slot), False):
                at = _slot_at(slot) + 8
                if os.pread(self._fd, 8, at) != bytes(8):   # nothing written where not needed
                    os.pwrite(self._fd, bytes(8), at)
                return slot
        raise OSError(errno.EUSERS, f"all {SLOTS} slots of {self.path} are held by open tiers")

    @contextmanager
    def locked(self) -> Iterator[Usage]:
        """Hold the ledger's lock (no other tier reserves, evicts or commits meanwhile) and
        yield the namespace's `Usage`; what the caller changed in it is written back when
        the block ends, even when it raises (files it removed are gone either way).

        Raises:
            OSError: reading, writing or locking the ledger failed.
        """
        with self._mutex:
            _lock(self._fd, fcntl.F_WRLCK, 0, True)
            try:
                total = _U64.unpack(os.pread(self._fd, 8, 8))[0]
                usage = Usage(total)
                try:
                    yield usage
                finally:
                    if usage.total != total:
                        os.pwrite(self._fd, _U64.pack(usage.total), 8)
                    if usage.reserved:
                        for name, nbytes in usage.reserved:
                            self._in_flight.setdefault(name, []).append(nbytes)
                            self._pending += nbytes
                        self._write_pending()
            finally:
                _lock(self._fd, fcntl.F_UNLCK, 0, True)

    def _write_pending(self) -> None:
        os.pwrite(self._fd, _U64.pack(self._pending), _slot_at(self._slot) + 8)

    def _ended(self, nbytes: int, name: Hashable) -> None:
        """Forget one store of `name` in flight (`nbytes`); the caller holds the lock."""
        sizes = self._in_flight.get(name)
        if sizes:
            if nbytes in sizes:
                sizes.remove(nbytes)
            else:
                sizes.pop()
            if not sizes:
                del self._in_flight[name]
        self._pending -= nbytes

    def commit(self, nbytes: int, name: Hashable) -> None:
        """A store of `nbytes` reserved by this ledger finished: its file, named `name` (as
        the listing passed to `rebase` names files), is in place. Raises OSError."""
        with self._mutex:
            _lock(self._fd, fcntl.F_WRLCK, 0, True)
            try:
                committed = _U64.unpack(os.pread(self._fd, 8, 16))[0]
                os.pwrite(self._fd, _U64.pack(committed + nbytes), 16)
                self._ended(nbytes, name)
                self._write_pending()
                if self._window is not None:
                    self._window.append((name, nbytes))
            finally:
                _lock(self._fd, fcntl.F_UNLCK, 0, True)

    def release(self, nbytes: int, name: Hashable) -> None:
        """A store of `nbytes` (file `name`) reserved by this ledger failed and left no file.
        Raises OSError."""
        with self.locked() as usage:
            usage.free(nbytes)
            self._ended(nbytes, name)
            self._write_pending()

    def total(self) -> int:
        """The namespace's total now (without the lock: a moment's value). Raises OSError."""
        return _U64.unpack(os.pread(self._fd, 8, 8))[0]

    def mark(self) -> int:
        """The committed sum now: take it before listing the folder for `rebase` (one listing
        at a time). Raises OSError."""
        with self._mutex:
            _lock(self._fd, fcntl.F_WRLCK, 0, True)
            try:
                self._window = []
                return _U64.unpack(os.pread(self._fd, 8, 16))[0]
            finally:
                _lock(self._fd, fcntl.F_UNLCK, 0, True)

    def rebase(self, mark: int, chunk_bytes: int, listed: Container[Hashable]) -> None:
        """Set the total from a listing of the folder that began after `mark` (`mark()`),
        found `chunk_bytes` of chunk files and the files named in `listed`: plus the
        reservations of live slots and what was committed since `mark`, less this ledger's
        stores (in flight, or committed since `mark`) whose files the listing found (other
        processes' are counted once more: their files may or may not be in the listing).
        Frees the slots of dead owners. Raises OSError."""
        with self._mutex:
            window, self._window = self._window or [], None
            _lock(self._fd, fcntl.F_WRLCK, 0, True)
            try:
                if self._damaged():
                    self._create(chunk_bytes)
                    self._write_pending()
                data = os.pread(self._fd, FILE_BYTES, 0)
                committed = _COUNTS.unpack_from(data, 8)[1]
                # a store in flight whose file the listing found (renamed, not committed
                # yet) is counted once
                held = self._pending - sum(sizes[0] for name, sizes in self._in_flight.items()
                                           if name in listed)
                for slot in range(SLOTS):
                    pending = _U64.unpack_from(data, _slot_at(slot) + 8)[0]
                    if not pending or slot == self._slot:
                        continue
                    if _lock(self._fd, fcntl.F_WRLCK, _slot_at(slot), False):
                        os.pwrite(self._fd, _U64.pack(0), _slot_at(slot) + 8)
                        _lock(self._fd, fcntl.F_UNLCK, _slot_at(slot), True)
                    else:
                        held += pending
                # a ledger re-created meanwhile restarted its sum from 0
                since = committed - mark if committed >= mark else committed
                since -= sum(nbytes for name, nbytes in window if name in listed)
                total = chunk_bytes + held + max(0, since)
                os.pwrite(self._fd, _U64.pack(total), 8)
            finally:
                _lock(self._fd, fcntl.F_UNLCK, 0, True)

    def close(self) -> None:
        """Give the slot back (its reservations are dropped: close after the stores ended)
        and close the file. Idempotent; never raises for I/O errors."""
        with self._mutex:
            if self._fd < 0:
                return
            try:
                os.pwrite(self._fd, _U64.pack(0), _slot_at(self._slot) + 8)
            except OSError:
                pass
            os.close(self._fd)    # drops this description's locks
            self._fd = -1


def read_usage(ns_dir: str) -> UsageSnapshot:
    """What the ledger of the namespace folder `ns_dir` holds now, read under its lock (for
    tools and tests). Raises OSError (FileNotFoundError: no ledger)."""
    fd = os.open(os.path.join(ns_dir, USAGE_FILE), os.O_RDWR | os.O_CLOEXEC)
    try:
        _lock(fd, fcntl.F_WRLCK, 0, True)
        data = os.pread(fd, FILE_BYTES, 0)
    finally:
        os.close(fd)
    _, total, committed = _HEADER.unpack_from(data, 0)
    pending = sum(_U64.unpack_from(data, _slot_at(slot) + 8)[0] for slot in range(SLOTS))
    return UsageSnapshot(total, committed, pending)
