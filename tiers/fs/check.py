"""Offline verification of an fs tier directory (`kvhal fsck DIR [--repair]`).

Reads every chunk file of every namespace under a root folder in full and checks its header,
key, size and xxh3-128 payload checksum (`fileio.verify_file`); counts temp files left by
writers that died (`scan.orphaned_temp_files`). Repair moves corrupt files into the
namespace's `quarantine/` folder and deletes orphaned temp files; good files are never touched.
"""
from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass, field

from ..chunk_format import CorruptChunk
from .fileio import quarantine_file, verify_file
from .format import (CHUNKS_DIR, QUARANTINE_DIR, is_namespace_dir_name, key_from_name,
                     temp_owner_pid)
from .scan import orphaned_temp_files


@dataclass(slots=True)
class CheckReport:
    """What `check_dir` found (bytes are file sizes on disk).

    Attributes:
        namespaces: Namespace folders seen.
        good, good_bytes: Chunk files that passed every check.
        corrupt, corrupt_bytes: Chunk files that failed a check (moved away if `repaired`).
        orphaned_temps, orphaned_temp_bytes: Temp files of dead writers (deleted if `repaired`).
        quarantined: Files in quarantine folders after this run.
        other_files: Files in chunk folders that are neither chunk nor temp files (left
            alone).
        unreadable: Chunk objects a GET failed for (obj tier only): not verified, never
            repaired, not counted as corrupt.
        problems: (path, reason) of each corrupt file (and unreadable object).
        repaired: Whether repair was requested.
    """

    namespaces: int = 0
    good: int = 0
    good_bytes: int = 0
    corrupt: int = 0
    corrupt_bytes: int = 0
    orphaned_temps: int = 0
    orphaned_temp_bytes: int = 0
    quarantined: int = 0
    other_files: int = 0
    unreadable: int = 0
    problems: list[tuple[str, str]] = field(default_factory=list)
    repaired: bool = False


def _files(folder: str) -> list[os.DirEntry]:
    try:
        return [e for e in os.scandir(folder) if e.is_file(follow_symlinks=False)]
    except OSError:
        return []


def _check_namespace(ns_dir: str, namespace: bytes, report: CheckReport, repair: bool) -> None:
    chunks = os.path.join(ns_dir, CHUNKS_DIR)
    subdirs = sorted(e.path for e in os.scandir(chunks) if e.is_dir()) if os.path.isdir(
        chunks) else []
    for sub in subdirs:
        for entry in _files(sub):
            key = key_from_name(namespace, entry.name)
            if key is None:
                # temp files are counted below if orphaned; a live writer's is not "other"
                report.other_files += temp_owner_pid(entry.name) is None
                continue
            try:
                size = entry.stat().st_size
                verify_file(entry.path, namespace, key)
            except FileNotFoundError:  # evicted or replaced by a live tier meanwhile
                continue
            except CorruptChunk as exc:
                reason = str(exc)
            except OSError as exc:
                reason = f"{errno.errorcode.get(exc.errno or 0, 'OSError')}: {exc.strerror}"
            else:
                report.good += 1
                report.good_bytes += size
                continue
            report.corrupt += 1
            report.corrupt_bytes += size
            report.problems.append((entry.path, reason))
            if repair:
                quarantine_file(ns_dir, entry.path)
    for path, size in orphaned_temp_files(ns_dir, time.time()):
        report.orphaned_temps += 1
        report.orphaned_temp_bytes += size
        if repair:
            try:
                os.unlink(path)
            except OSError:
                pass
    report.quarantined += len(_files(os.path.join(ns_dir, QUARANTINE_DIR)))


def check_dir(root_dir: str, repair: bool = False) -> CheckReport:
    """Verify every namespace folder under `root_dir` (see module docstring).

    Raises:
        NotADirectoryError: `root_dir` is not a directory.
        ValueError: `root_dir` is itself a namespace folder (its parent is the root_dir).
        OSError: `root_dir` cannot be listed.
    """
    if not os.path.isdir(root_dir):
        raise NotADirectoryError(f"not a directory: {root_dir}")
    if (is_namespace_dir_name(os.path.basename(os.path.normpath(root_dir)))
            and os.path.isdir(os.path.join(root_dir, CHUNKS_DIR))):
        raise ValueError(f"{root_dir} is a namespace folder; pass the tier's root_dir "
                         f"(its parent, {os.path.dirname(os.path.abspath(root_dir))})")
    report = CheckReport(repaired=repair)
    for entry in sorted(os.scandir(root_dir), key=lambda e: e.name):
        if entry.is_dir() and is_namespace_dir_name(entry.name):
            report.namespaces += 1
            _check_namespace(entry.path, bytes.fromhex(entry.name), report, repair)
    return report
