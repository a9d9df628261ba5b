"""The fs tier's in-memory index: which chunk files exist, their sizes, and LRU order.

Lookups consult only this index (no disk I/O). It is filled from the directory at start and
kept in step with files other processes write or delete by `scan_namespace` on a background
thread; `reconcile` merges a scan without dropping entries added while the scan ran.
"""
from __future__ import annotations

import collections
import os
import threading
from dataclasses import dataclass, field

from kvhal.keys import ChunkKey

from .fileio import CorruptChunk, read_header
from .format import CHUNKS_DIR, TEMP_DIR, key_from_name, temp_owner_pid

#: A temp file whose writer pid is not running here is orphaned after this many seconds; any
#: temp file is orphaned after `TEMP_MAX_AGE_S` (covers writers in another pid namespace).
TEMP_DEAD_OWNER_AGE_S = 10.0
TEMP_MAX_AGE_S = 3600.0


@dataclass(slots=True)
class ScanResult:
    """What one pass over a namespace folder found.

    Attributes:
        found: Every valid chunk file, key → file bytes.
        bad: Paths whose header failed a check (left in place; `kvhal fsck` reports them).
    """

    found: dict[ChunkKey, int] = field(default_factory=dict)
    bad: list[str] = field(default_factory=list)


def scan_namespace(ns_dir: str, namespace: bytes, known: dict[ChunkKey, int]) -> ScanResult:
    """List the chunk files of one namespace folder.

    Files whose key is in `known` are taken at the known size without any I/O beyond the
    directory listing; new files get their header read and checked (`read_header`). Files
    that vanish during the scan are skipped. Never raises for I/O errors on single files.

    Raises:
        OSError: a folder exists but cannot be listed (EMFILE, EIO, EACCES, ...): the caller
            must keep its index rather than take the folder for empty. A folder that is gone
            (ENOENT) counts as empty.
    """
    out = ScanResult()
    chunks = os.path.join(ns_dir, CHUNKS_DIR)
    try:
        subdirs = [e.path for e in os.scandir(chunks) if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return out
    for sub in subdirs:
        try:
            entries = list(os.scandir(sub))
        except FileNotFoundError:
            continue
        for entry in entries:
            key = key_from_name(namespace, entry.name)
            if key is None:
                continue
            if key in known:
                out.found[key] = known[key]
                continue
            try:
                header, size = read_header(entry.path, namespace)
            except CorruptChunk:
                out.bad.append(entry.path)
                continue
            except OSError:
                continue
            if header.key == key:
                out.found[key] = size
            else:
                out.bad.append(entry.path)
    return out


class ChunkIndex:
    """Thread-safe LRU map of chunk key → file bytes, with byte accounting.

    `used_bytes` counts indexed files plus bytes reserved by stores in flight.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lru: collections.OrderedDict[ChunkKey, int] = collections.OrderedDict()
        self._added_epoch: dict[ChunkKey, int] = {}
        self._removed_epoch: dict[ChunkKey, int] = {}
        self._epoch = 0
        self._indexed = 0
        self._reserved = 0

    def __contains__(self, key: ChunkKey) -> bool:
        with self._lock:
            return key in self._lru

    def __len__(self) -> int:
        with self._lock:
            return len(self._lru)

    @property
    def used_bytes(self) -> int:
        """Bytes of indexed files plus reservations."""
        with self._lock:
            return self._indexed + self._reserved

    def snapshot(self) -> tuple[dict[ChunkKey, int], int]:
        """A copy of the map and a new epoch; pass both to `reconcile` after scanning."""
        with self._lock:
            self._epoch += 1
            return dict(self._lru), self._epoch

    def reconcile(self, scan: ScanResult, epoch: int) -> None:
        """Merge a scan started at `epoch`: add new files (as most recently used) unless they
        were removed after the scan began, and drop entries whose files are gone unless they
        were added after the scan began."""
        with self._lock:
            removed, self._removed_epoch = self._removed_epoch, {}
            for key in [k for k in self._lru if k not in scan.found
                        and self._added_epoch.get(k, 0) < epoch]:
                self._indexed -= self._lru.pop(key)
                self._added_epoch.pop(key, None)
            for key, nbytes in scan.found.items():
                if key not in self._lru and removed.get(key, -1) < epoch:
                    self._lru[key] = nbytes
                    self._indexed += nbytes
                    self._added_epoch[key] = epoch

    def touch(self, key: ChunkKey) -> bool:
        """Mark `key` most recently used; False if it is not indexed."""
        with self._lock:
            if key not in self._lru:
                return False
            self._lru.move_to_end(key)
            return True

    def add(self, key: ChunkKey, nbytes: int) -> None:
        """Index a file (most recently used)."""
        with self._lock:
            if key in self._lru:
                self._lru.move_to_end(key)
                return
            self._lru[key] = nbytes
            self._indexed += nbytes
            self._added_epoch[key] = self._epoch + 1

    def discard(self, key: ChunkKey) -> None:
        """Forget `key` after its file was deleted or moved away (a scan that listed the file
        before that does not bring it back)."""
        with self._lock:
            self._removed_epoch[key] = self._epoch
            if key in self._lru:
                self._indexed -= self._lru.pop(key)
                self._added_epoch.pop(key, None)

    def reserve(self, nbytes: int, max_bytes: int) -> list[tuple[ChunkKey, int]] | None:
        """Reserve `nbytes` for a store, taking least recently used entries out of the index
        until everything fits in `max_bytes`. Returns the victims (their files must be
        deleted by the caller, who then calls `discard` for each), or None if `nbytes` alone
        exceeds `max_bytes`."""
        with self._lock:
            if nbytes > max_bytes:
                return None
            victims = []
            while self._lru and self._indexed + self._reserved + nbytes > max_bytes:
                victims.append(self._pop_lru())
            self._reserved += nbytes
            return victims

    def release(self, nbytes: int) -> None:
        """Return a reservation (the store finished or failed)."""
        with self._lock:
            self._reserved -= nbytes

    def evict_lru(self, nbytes: int) -> list[tuple[ChunkKey, int]]:
        """Take least recently used entries totalling at least `nbytes` out of the index (the
        caller deletes their files, then calls `discard` for each)."""
        with self._lock:
            victims, freed = [], 0
            while self._lru and freed < nbytes:
                victims.append(self._pop_lru())
                freed += victims[-1][1]
            return victims

    def _pop_lru(self) -> tuple[ChunkKey, int]:
        key, size = self._lru.popitem(last=False)
        self._added_epoch.pop(key, None)
        self._indexed -= size
        return key, size


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def orphaned_temp_files(ns_dir: str, now: float) -> list[tuple[str, int]]:
    """Temp files in `ns_dir` left by writers that died: (path, bytes) pairs.

    A temp file is orphaned when the pid in its name is not running on this host and it is at
    least `TEMP_DEAD_OWNER_AGE_S` old, or when it is at least `TEMP_MAX_AGE_S` old. `now` is
    `time.time()`. Never raises for I/O errors.
    """
    out = []
    try:
        entries = list(os.scandir(os.path.join(ns_dir, TEMP_DIR)))
    except OSError:
        return out
    for entry in entries:
        pid = temp_owner_pid(entry.name)
        if pid is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        age = now - st.st_mtime
        if age >= TEMP_MAX_AGE_S or (age >= TEMP_DEAD_OWNER_AGE_S and not _pid_alive(pid)):
            out.append((entry.path, st.st_size))
    return out
