"""The in-memory index of a storage tier: which chunks it holds, their bytes, and LRU order.

Shared by the tiers that keep chunks outside this process (fs files, obj objects). Lookups
consult only this index (no I/O). A tier fills it from a listing of its store at start and
keeps it in step with what other processes write or delete by listing again on a background
thread: `snapshot` before the listing, `reconcile` after it, which merges without dropping
entries added (or resurrecting entries removed) while the listing ran.

Every key that leaves the index (evicted, discarded, gone from a listing) is remembered until
`take_removed` hands it out, so the tier can report it as a removal (a `BlockRemoved` event);
at most `MAX_REMEMBERED_REMOVALS` are kept between calls (the oldest are dropped: a consumer
then holds a stale entry, which costs it one failed load).

A key `forget` drops after a failed load stays *doubted* until a store of it is indexed: a
listing may bring it back (its store still lists the record), but `skip_store` never takes
the record as stored, so the next store writes it anew.
"""
from __future__ import annotations

import collections
import math
import threading
import time
from typing import Callable, Iterable, Mapping

from kvhal.keys import ChunkKey

MAX_REMEMBERED_REMOVALS = 1 << 16


class StoresInFlight(Exception):
    """`ChunkIndex.reserve` refused a store: the reservations of stores in flight leave too
    little of `max_bytes` for it even with every indexed chunk evicted (nothing was evicted).
    Only a tier smaller than its write threads' chunks in flight meets it; the store is a
    miss, and the tier stays within `max_bytes`. The message gives the bytes."""


class ChunkIndex:
    """Thread-safe LRU map of chunk key → stored bytes, with byte accounting.

    `used_bytes` counts indexed bytes plus bytes reserved by stores in flight. The caller
    deletes the stored objects of the victims `reserve` and `evict_lru` return.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lru: collections.OrderedDict[ChunkKey, int] = collections.OrderedDict()
        self._added_epoch: dict[ChunkKey, int] = {}
        self._removed_epoch: dict[ChunkKey, int] = {}
        self._epoch = 0
        self._indexed = 0
        self._reserved = 0
        #: key → monotonic deadline before which no listing brings the key back.
        self._held: dict[ChunkKey, float] = {}
        self._gone: collections.deque[ChunkKey] = collections.deque(
            maxlen=MAX_REMEMBERED_REMOVALS)
        #: Keys forgotten (`forget`) and not stored since, oldest first; at most
        #: `MAX_REMEMBERED_REMOVALS` (the oldest are dropped: such a key's record may then be
        #: taken as stored, which costs one more failed load and forget).
        self._doubted: dict[ChunkKey, None] = {}
        #: Keys a listing added (`reconcile`) and `take_found` has not handed out yet.
        self._found: list[ChunkKey] = []
        #: Called (outside the lock) after a `reconcile` that added or dropped keys
        #: (`SecondaryTier.watch`).
        self.on_change: Callable[[], None] | None = None

    def __contains__(self, key: ChunkKey) -> bool:
        with self._lock:
            return key in self._lru

    def __len__(self) -> int:
        with self._lock:
            return len(self._lru)

    @property
    def used_bytes(self) -> int:
        """Bytes of indexed chunks plus reservations."""
        with self._lock:
            return self._indexed + self._reserved

    def snapshot(self) -> tuple[dict[ChunkKey, int], int]:
        """A copy of the map and a new epoch; pass both to `reconcile` after scanning."""
        with self._lock:
            self._epoch += 1
            return dict(self._lru), self._epoch

    def reconcile(self, found: Mapping[ChunkKey, int], epoch: int) -> None:
        """Merge a listing (key → stored bytes) started at `epoch`: add new keys (as most
        recently used) unless they were removed after the listing began or are held (`hold`),
        and drop entries the listing did not find unless they were added after it began."""
        now = time.monotonic()
        with self._lock:
            self._held = {k: t for k, t in self._held.items() if t > now}
            removed, self._removed_epoch = self._removed_epoch, {}
            changed = [k for k in self._lru if k not in found
                       and self._added_epoch.get(k, 0) < epoch]
            for key in changed:
                self._indexed -= self._lru.pop(key)
                self._added_epoch.pop(key, None)
                self._gone.append(key)
            for key, nbytes in found.items():
                if (key not in self._lru and removed.get(key, -1) < epoch
                        and key not in self._held):
                    self._lru[key] = nbytes
                    self._indexed += nbytes
                    self._added_epoch[key] = epoch
                    self._found.append(key)
                    changed.append(key)
        if changed and self.on_change is not None:
            self.on_change()

    def touch(self, key: ChunkKey) -> bool:
        """Mark `key` most recently used; False if it is not indexed."""
        with self._lock:
            if key not in self._lru:
                return False
            self._lru.move_to_end(key)
            return True

    def add(self, key: ChunkKey, nbytes: int) -> None:
        """Index a chunk of `nbytes` stored bytes that a check found in the store (most
        recently used); a doubted key (`forget`) stays doubted: a check of its name is no
        proof that its record can be served."""
        with self._lock:
            self._add(key, nbytes)

    def add_many(self, chunks: Iterable[tuple[ChunkKey, int]]) -> None:
        """Index each (key, stored bytes) of a batch, in order, under one lock: chunks a store
        wrote or a load read back whole, so each one's doubt (`forget`) ends."""
        with self._lock:
            for key, nbytes in chunks:
                self._add(key, nbytes)
                self._doubted.pop(key, None)

    def _add(self, key: ChunkKey, nbytes: int) -> None:
        if key in self._lru:
            self._lru.move_to_end(key)
            return
        self._lru[key] = nbytes
        self._indexed += nbytes
        self._added_epoch[key] = self._epoch  # protected from listings begun before

    def discard(self, key: ChunkKey) -> None:
        """Forget `key` after its stored object was deleted or found unusable (a listing that
        saw it before that does not bring it back)."""
        with self._lock:
            self._discard(key)

    def _discard(self, key: ChunkKey) -> None:
        self._removed_epoch[key] = self._epoch
        if key in self._lru:
            self._indexed -= self._lru.pop(key)
            self._added_epoch.pop(key, None)
            self._gone.append(key)

    def forget(self, keys: Iterable[ChunkKey]) -> None:
        """`discard` each of `keys` under one lock and doubt it: chunks a failed load put in
        doubt (`SecondaryTier.forget`), whose stored records may or may not still be there and
        be whole. A listing that began before does not bring them back; a later one does if it
        finds them, but each stays doubted (`skip_store`, `doubted`) until a store of it is
        indexed (`release` with it, `add_many`)."""
        with self._lock:
            for key in keys:
                self._discard(key)
                self._doubted.pop(key, None)
                self._doubted[key] = None
            while len(self._doubted) > MAX_REMEMBERED_REMOVALS:
                del self._doubted[next(iter(self._doubted))]

    def doubted(self, key: ChunkKey) -> bool:
        """True if `key` was forgotten (`forget`) and not stored since: its store must replace
        a record its store may still hold (obj: an unconditional PUT; mooncake: remove, then
        put)."""
        with self._lock:
            return key in self._doubted

    def skip_store(self, key: ChunkKey) -> bool:
        """True if a store of `key` may end without writing: it is indexed and not doubted
        (then it is marked most recently used, as `touch`). A doubted key that a listing
        brought back is discarded here, so the store that follows writes it anew and indexes
        it once (its reservation cannot evict it meanwhile)."""
        with self._lock:
            if key in self._doubted:
                self._discard(key)
                return False
            if key not in self._lru:
                return False
            self._lru.move_to_end(key)
            return True

    def hold(self, keys: Iterable[ChunkKey], until: float = math.inf) -> None:
        """Discard `keys` and keep listings from bringing them back before the monotonic time
        `until` (`time.monotonic()` seconds; inf: until `unhold`). Used after a failed load (a
        bad chunk is not offered again at every step) and while a DELETE is in flight."""
        keys = list(keys)
        with self._lock:
            for key in keys:
                self._held[key] = max(until, self._held.get(key, 0.0))
        for key in keys:
            self.discard(key)

    def unhold(self, keys: Iterable[ChunkKey]) -> None:
        """End the holds of `keys` (their stored objects are gone now) and discard them again,
        so a listing that saw them before they went cannot bring them back."""
        keys = list(keys)
        for key in keys:
            self.discard(key)
        with self._lock:
            for key in keys:
                self._held.pop(key, None)

    def reserve(self, nbytes: int, max_bytes: int) -> list[tuple[ChunkKey, int]] | None:
        """Reserve `nbytes` for a store, taking least recently used entries out of the index
        until everything fits in `max_bytes`. Returns the victims (key, bytes), whose stored
        objects the caller deletes, or None if `nbytes` alone exceeds `max_bytes`.

        Raises:
            StoresInFlight: other reservations hold more than `max_bytes - nbytes` bytes.
        """
        with self._lock:
            if nbytes > max_bytes:
                return None
            self._check_in_flight(nbytes, max_bytes)
            victims = []
            while self._lru and self._indexed + self._reserved + nbytes > max_bytes:
                victims.append(self._pop_lru())
            self._reserved += nbytes
            return victims

    def reserve_room(self, nbytes: int, max_bytes: int) -> None:
        """Reserve `nbytes` for a store whose room the caller makes itself (the fs tier
        evicts with `pop_lru` against a count that other processes share: its `ledger.py`).

        Raises:
            StoresInFlight: other reservations hold more than `max_bytes - nbytes` bytes.
        """
        with self._lock:
            self._check_in_flight(nbytes, max_bytes)
            self._reserved += nbytes

    def pop_lru(self) -> tuple[ChunkKey, int] | None:
        """Take the least recently used entry out of the index: (key, bytes), whose stored
        object the caller deletes; None if the index is empty."""
        with self._lock:
            return self._pop_lru() if self._lru else None

    def release(self, nbytes: int, stored: ChunkKey | None = None) -> None:
        """End a reservation of `nbytes`: a failed store's, or with `stored` a finished one's,
        whose chunk is indexed (as `add`) in the same step, so that its bytes count all along
        (a store reserving in between would otherwise see room that is not there), and its
        doubt (`forget`) ends."""
        with self._lock:
            self._reserved -= nbytes
            if stored is not None:
                self._add(stored, nbytes)
                self._doubted.pop(stored, None)

    def evict_lru(self, nbytes: int) -> list[tuple[ChunkKey, int]]:
        """Take least recently used entries totalling at least `nbytes` out of the index; the
        caller deletes their stored objects."""
        with self._lock:
            victims, freed = [], 0
            while self._lru and freed < nbytes:
                victims.append(self._pop_lru())
                freed += victims[-1][1]
            return victims

    def take_found(self) -> list[ChunkKey]:
        """Keys listings added since the last call (`reconcile`: what the store held at start,
        then what other processes wrote), in the order found; each once, unless it left the
        index and a listing found it again."""
        with self._lock:
            out, self._found = self._found, []
            return out

    def take_removed(self) -> list[ChunkKey]:
        """Keys that left the index since the last call (each once), oldest first."""
        with self._lock:
            out = list(self._gone)
            self._gone.clear()
            return out

    def _check_in_flight(self, nbytes: int, max_bytes: int) -> None:
        if self._reserved + nbytes > max_bytes:
            raise StoresInFlight(f"{nbytes} bytes do not fit in max_bytes {max_bytes} while "
                                 f"stores in flight hold {self._reserved} bytes")

    def _pop_lru(self) -> tuple[ChunkKey, int]:
        key, size = self._lru.popitem(last=False)
        # as `discard`: a listing begun before saw the victim's file, which is going
        self._removed_epoch[key] = self._epoch
        self._added_epoch.pop(key, None)
        self._indexed -= size
        self._gone.append(key)
        return key, size
