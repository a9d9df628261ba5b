"""What the fs tier's jobs under way hold: a store's reservation, and counts of the stores and
loads of each key in flight (a refresh must not index a file a store is publishing, and a store
must not recycle a file a load is reading)."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Iterable

from kvhal.keys import ChunkKey


@dataclass(frozen=True, slots=True)
class Reservation:
    """How a store begins (`FsTier._store_begin`).

    Attributes:
        nbytes: Record bytes reserved in the index until the store ends; 0 if nothing was
            reserved: the store ends now, with `error`.
        reuse: The evicted key whose file the store overwrites in place, or None.
        reuse_path: Where that file lies now (renamed to a temp name of the store's process
            when it was claimed: `fileio.claim_file`), or None.
        error: Why the store fails (nothing reserved), or None: it succeeds (reserved, or the
            chunk was stored already).
    """

    nbytes: int = 0
    reuse: ChunkKey | None = None
    reuse_path: str | None = None
    error: str | None = None

    def keys(self, key: ChunkKey) -> tuple[ChunkKey, ...]:
        """The keys a reserved store of `key` holds: its own, then its recycled victim's."""
        return (key,) if self.reuse is None else (key, self.reuse)


class KeyCounts:
    """How many jobs of one kind hold each chunk key now (a key counted 0 times is absent).
    Thread-safe."""

    def __init__(self) -> None:
        self._counts: dict[ChunkKey, int] = {}
        self._lock = threading.Lock()

    def add(self, keys: Iterable[ChunkKey], step: int = 1) -> None:
        """Count each of `keys` in (`step` 1) or out (-1) once."""
        counts = self._counts
        with self._lock:
            for key in keys:
                left = counts.get(key, 0) + step
                if left:
                    counts[key] = left
                else:
                    del counts[key]

    def remove(self, keys: Iterable[ChunkKey]) -> None:
        """Count each of `keys` out once (each was added before)."""
        self.add(keys, -1)

    def snapshot(self) -> frozenset[ChunkKey]:
        """The keys held now."""
        with self._lock:
            return frozenset(self._counts)

    def unless_held(self, key: ChunkKey, action: Callable[[], None]) -> None:
        """Run `action` if `key` is not held, with no `add` of any key in between."""
        with self._lock:
            if key not in self._counts:
                action()
