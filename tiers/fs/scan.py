"""Scanning an fs tier's namespace folder: which chunk files exist (for `ChunkIndex`) and which
temp files writers that died left behind.

The tier's index (`kvhal.tiers.index.ChunkIndex`) is filled from `scan_namespace` at start and
kept in step with files other processes write or delete by a scan on a background thread; the
same scan finds the temp files of writers that died (the tier removes them).
"""
from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field

from kvhal.keys import ChunkKey

from ..chunk_format import CorruptChunk
from .fileio import read_header
from .format import (CHUNKS_DIR, LEGACY_TEMP_DIR, is_chunk_file_name, key_from_name,
                     temp_owner_pid)

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
        orphans: Temp files of the chunk folders left by writers that died, (path, bytes)
            (see `orphaned_temp_files`).
        unindexed_bytes: Bytes of the chunk files not in `found` (in `bad`, or unreadable).
    """

    found: dict[ChunkKey, int] = field(default_factory=dict)
    bad: list[str] = field(default_factory=list)
    orphans: list[tuple[str, int]] = field(default_factory=list)
    unindexed_bytes: int = 0

    @property
    def chunk_bytes(self) -> int:
        """Bytes of every chunk file (`*.kv`) found, indexed or not (`ledger.py`)."""
        return sum(self.found.values()) + self.unindexed_bytes


def scan_namespace(ns_dir: str, namespace: bytes, known: dict[ChunkKey, int],
                   now: float | None = None) -> ScanResult:
    """List the chunk files of one namespace folder, and the orphaned temp files among them.

    Files whose key is in `known` are taken at the known size without any I/O beyond the
    directory listing; new files get their header read and checked (`read_header`). Files
    that vanish during the scan are skipped. Temp files are judged as `orphaned_temp_files`
    does at `now` (`time.time()`; default: now), so a tier that runs on removes the temp files
    of a writer that died meanwhile. Never raises for I/O errors on single files.

    Raises:
        OSError: a folder exists but cannot be listed (EMFILE, EIO, EACCES, ...): the caller
            must keep its index rather than take the folder for empty. A folder that is gone
            (ENOENT) counts as empty.
    """
    out = ScanResult()
    now = time.time() if now is None else now
    for entry in _chunk_folder_entries(ns_dir, strict=True):
        key = key_from_name(namespace, entry.name)
        if key is None:
            orphan = _orphan(entry, now)
            if orphan is not None:
                out.orphans.append(orphan)
            continue
        if key in known:
            out.found[key] = known[key]
            continue
        try:
            header, size = read_header(entry.path, namespace)
        except (CorruptChunk, OSError) as exc:
            if isinstance(exc, CorruptChunk):
                out.bad.append(entry.path)
            out.unindexed_bytes += _size(entry)
            continue
        if header.key == key:
            out.found[key] = size
        else:
            out.bad.append(entry.path)
            out.unindexed_bytes += size
    return out


def _size(entry: os.DirEntry) -> int:
    """Bytes of the file `entry` names (0 if it is gone)."""
    try:
        return entry.stat(follow_symlinks=False).st_size
    except OSError:
        return 0


def chunk_file_bytes(ns_dir: str) -> int:
    """Bytes of the chunk files (`*.kv`) in the chunk folders of `ns_dir` now, by one listing
    with a stat per file (files that vanish meanwhile count 0). A missing folder counts as
    empty.

    Raises:
        OSError: a folder exists but cannot be listed.
    """
    return sum(_size(entry) for entry in _chunk_folder_entries(ns_dir, strict=True)
               if is_chunk_file_name(entry.name))


def _chunk_folder_entries(ns_dir: str, strict: bool = False):
    """Every entry of the chunk folders of `ns_dir` (chunk files and temp files). A missing
    folder counts as empty; with `strict` other listing errors raise (`scan_namespace`), else
    the folder is skipped."""
    chunks = os.path.join(ns_dir, CHUNKS_DIR)
    try:
        subdirs = [e.path for e in os.scandir(chunks) if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return
    except OSError:
        if strict:
            raise
        return
    for sub in subdirs:
        try:
            entries = list(os.scandir(sub))
        except FileNotFoundError:
            continue
        except OSError:
            if strict:
                raise
            continue
        yield from entries


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` runs on this host (as far as `kill(pid, 0)` tells)."""
    if pid <= 0:  # a name's pid 0 would probe our own process group: no writer has it
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: no pid that large exists
        return False
    except PermissionError:
        return True
    return True


def _legacy_temp_entries(ns_dir: str):
    try:
        yield from list(os.scandir(os.path.join(ns_dir, LEGACY_TEMP_DIR)))
    except OSError:
        return


def orphaned_temp_files(ns_dir: str, now: float) -> list[tuple[str, int]]:
    """Temp files in `ns_dir` left by writers that died: (path, bytes) pairs.

    A temp file is orphaned when the pid in its name is not running on this host and it is at
    least `TEMP_DEAD_OWNER_AGE_S` old, or when it is at least `TEMP_MAX_AGE_S` old. Temp files
    of the chunk folders and of the `LEGACY_TEMP_DIR` folder (where earlier versions wrote
    them) count. `now` is `time.time()`. Never raises for I/O errors.
    """
    entries = itertools.chain(_chunk_folder_entries(ns_dir), _legacy_temp_entries(ns_dir))
    return [orphan for orphan in (_orphan(e, now) for e in entries) if orphan is not None]


def _orphan(entry: os.DirEntry, now: float) -> tuple[str, int] | None:
    """(path, bytes) of `entry` if it is an orphaned temp file (see `orphaned_temp_files`)."""
    pid = temp_owner_pid(entry.name)
    if pid is None:
        return None
    try:
        st = entry.stat(follow_symlinks=False)
    except OSError:
        return None
    age = now - st.st_mtime
    if age >= TEMP_MAX_AGE_S or (age >= TEMP_DEAD_OWNER_AGE_S and not pid_alive(pid)):
        return entry.path, st.st_size
    return None
