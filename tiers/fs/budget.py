"""The fs tier's root-wide disk budget: `max_bytes` covers every namespace under `root_dir`.

A new model, revision, dtype or chunk size is a new namespace folder under the same `root_dir`;
without a root-wide budget each would grow to `max_bytes` and the disk fills. Each tier marks
its namespace as in use by rewriting `<namespace>/in_use` (mtime = last refresh, content = its
refresh interval) at start and on every refresh. `RootBudget` sums the bytes of every other
namespace folder, and when a store needs room:

1. namespaces nobody uses (marker older than `STALE_AFTER_INTERVALS` refresh intervals of
   their owner, at least `MIN_STALE_S`; no marker = stale) are deleted whole, least recently
   used first: caches of old models and configs go before anything in use;
2. what other namespaces in use hold is subtracted from the budget left to this namespace,
   whose own least recently used chunks are then evicted (the tier's `ChunkIndex`).

Deleting a namespace another process still reads costs it misses, never wrong bytes (its loads
find no file).
"""
from __future__ import annotations

import os
import shutil
import threading
import time
from dataclasses import dataclass

from .format import is_namespace_dir_name

#: Name of the in-use marker file inside a namespace folder.
IN_USE_FILE = "in_use"
#: A namespace is stale once its marker is this many of its owner's refresh intervals old...
STALE_AFTER_INTERVALS = 10
#: ...and at least this old (seconds), so a loaded machine's slow refresh is not taken as death.
MIN_STALE_S = 60.0


@dataclass(frozen=True, slots=True)
class Namespace:
    """One other namespace folder under `root_dir`.

    Attributes:
        path: The folder.
        nbytes: Bytes of its regular files (chunk, temp and quarantined files).
        last_used: Unix time of its last in-use mark (0.0 without a marker).
        stale: Whether no process has marked it in use lately (see the module docstring).
    """

    path: str
    nbytes: int
    last_used: float
    stale: bool


def mark_in_use(ns_dir: str, refresh_interval_s: float) -> None:
    """Rewrite `ns_dir/in_use` (its mtime says "in use now"). Raises OSError."""
    path = os.path.join(ns_dir, IN_USE_FILE)
    with open(path, "w") as f:
        f.write(f"{refresh_interval_s}\n")


def _folder_bytes(path: str) -> int:
    total, stack = 0, [path]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                elif entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
            except OSError:
                continue
    return total


def _last_used(path: str, now: float) -> tuple[float, bool]:
    marker = os.path.join(path, IN_USE_FILE)
    try:
        mtime = os.stat(marker).st_mtime
        with open(marker) as f:
            interval = float(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0.0, True
    return mtime, now - mtime > max(MIN_STALE_S, STALE_AFTER_INTERVALS * interval)


def other_namespaces(root_dir: str, own: str, now: float) -> list[Namespace]:
    """Every namespace folder under `root_dir` except `own` (a folder name), least recently
    used first. Never raises for I/O errors (an unlistable root yields [])."""
    try:
        names = [e.name for e in os.scandir(root_dir)
                 if e.is_dir(follow_symlinks=False) and is_namespace_dir_name(e.name)
                 and e.name != own]
    except OSError:
        return []
    out = []
    for name in names:
        path = os.path.join(root_dir, name)
        last, stale = _last_used(path, now)
        out.append(Namespace(path, _folder_bytes(path), last, stale))
    return sorted(out, key=lambda n: n.last_used)


class RootBudget:
    """What the other namespaces under `root_dir` hold, and room made by deleting stale ones.

    Args:
        root_dir: The fs tier's `root_dir`.
        own: This tier's namespace folder name (never touched here).

    Thread-safe. `rescan` lists the root (call at start and now and then); `room_for` uses the
    last listing.
    """

    def __init__(self, root_dir: str, own: str):
        self.root_dir = root_dir
        self.own = own
        self._lock = threading.Lock()
        self._others: list[Namespace] = []
        #: Namespaces deleted because they were stale.
        self.namespaces_deleted = 0

    @property
    def others_bytes(self) -> int:
        """Bytes held by the other namespaces at the last listing (minus deleted ones)."""
        with self._lock:
            return sum(n.nbytes for n in self._others)

    def rescan(self, now: float | None = None) -> None:
        """List the other namespaces again (never raises for I/O errors)."""
        others = other_namespaces(self.root_dir, self.own, time.time() if now is None else now)
        with self._lock:
            self._others = others

    def room_for(self, own_bytes: int, max_bytes: int) -> int:
        """The bytes this namespace may hold under a root-wide `max_bytes`, after deleting
        stale namespaces (least recently used first) until `own_bytes` fits or none is left.

        Args:
            own_bytes: Bytes this namespace holds plus the store that asks.
            max_bytes: The root-wide budget.

        Returns:
            `max_bytes` minus what the remaining other namespaces hold (may be ≤ 0).
        """
        with self._lock:
            while own_bytes + sum(n.nbytes for n in self._others) > max_bytes:
                victim = next((n for n in self._others if n.stale), None)
                if victim is None:
                    break
                self._others.remove(victim)
                shutil.rmtree(victim.path, ignore_errors=True)
                self.namespaces_deleted += 1
            return max_bytes - sum(n.nbytes for n in self._others)
