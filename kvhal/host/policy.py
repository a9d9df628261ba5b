"""Host-tier cache policies (DESIGN §5): which idle chunk to evict first.

A policy only orders keys; the slot table decides what may be evicted (idle slots outside the
batch being stored) and passes that as `can_evict`. Policies register through the
`kvhal_register_cache_policies` hook as `PolicySpec(name, factory)` with
`factory(capacity: int) -> CachePolicy`; a third party adds one the same way.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable, Protocol, runtime_checkable

Key = Hashable


@runtime_checkable
class CachePolicy(Protocol):
    """The eviction order of resident chunks. Called from the manager's thread only.

    Keys are `ChunkKey`s (any hashable works). The slot table calls `insert` when a chunk
    becomes resident, `touch` on every hit, `remove` when it drops a chunk for a reason other
    than eviction, and `evict` to choose victims.
    """

    def insert(self, key: Key, cold: bool = False) -> None:
        """`key` became resident (it was not resident before); `cold`: nobody is waiting for
        it (a promotion whose request went away), put it first in line for eviction."""

    def touch(self, key: Key) -> None:
        """`key` was used (a lookup hit or a load). Unknown keys are ignored."""

    def remove(self, key: Key) -> None:
        """`key` left the cache without being evicted (discarded). Unknown keys are ignored."""

    def evict(self, n: int, can_evict: Callable[[Key], bool]) -> list[Key]:
        """Choose and forget up to `n` resident keys for which `can_evict(key)` is True.

        Returns:
            The victims, best first; fewer than `n` if not enough keys may be evicted.
        """


def _take(order: "OrderedDict[Key, None]", n: int, can_evict: Callable[[Key], bool]) -> list[Key]:
    """Up to n keys of `order`, oldest first, that may be evicted (removed from `order`)."""
    out = []
    for key in order:
        if can_evict(key):
            out.append(key)
            if len(out) == n:
                break
    for key in out:
        del order[key]
    return out


class LRUPolicy:
    """Least recently used first. All operations O(1) except `evict`, which skips keys that
    may not be evicted."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key, cold: bool = False) -> None:
        """See `CachePolicy.insert`."""
        self._order[key] = None
        if cold:
            self._order.move_to_end(key, last=False)

    def touch(self, key: Key) -> None:
        """See `CachePolicy.touch`."""
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Key) -> None:
        """See `CachePolicy.remove`."""
        self._order.pop(key, None)

    def evict(self, n: int, can_evict: Callable[[Key], bool]) -> list[Key]:
        """See `CachePolicy.evict`."""
        return _take(self._order, n, can_evict)


class ARCPolicy:
    """Adaptive Replacement Cache (Megiddo & Modha, FAST '03): a recency list T1 and a
    frequency list T2, ghost lists B1/B2 of recently evicted keys, and a target size `p` for T1
    that grows on a B1 ghost hit and shrinks on a B2 ghost hit.

    Differences from the paper, forced by the slot table: victims are taken from the preferred
    list's LRU end skipping keys that may not be evicted, falling back to the other list.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.p = 0.0
        self._t1: OrderedDict[Key, None] = OrderedDict()
        self._t2: OrderedDict[Key, None] = OrderedDict()
        self._b1: OrderedDict[Key, None] = OrderedDict()
        self._b2: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key, cold: bool = False) -> None:
        """See `CachePolicy.insert`: a ghost hit adapts `p` and enters T2, else T1; `cold`
        puts it at its list's LRU end."""
        if key in self._b1:
            self.p = min(float(self.capacity), self.p + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[key]
            into = self._t2
        elif key in self._b2:
            self.p = max(0.0, self.p - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[key]
            into = self._t2
        else:
            into = self._t1
        into[key] = None
        if cold:
            into.move_to_end(key, last=False)

    def touch(self, key: Key) -> None:
        """See `CachePolicy.touch`: a second use moves a key from T1 to T2."""
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def remove(self, key: Key) -> None:
        """See `CachePolicy.remove` (no ghost entry)."""
        self._t1.pop(key, None)
        self._t2.pop(key, None)

    def evict(self, n: int, can_evict: Callable[[Key], bool]) -> list[Key]:
        """See `CachePolicy.evict`: from T1 while it exceeds `p`, else from T2."""
        out: list[Key] = []
        while len(out) < n:
            first, ghost_first, second, ghost_second = (
                (self._t1, self._b1, self._t2, self._b2) if len(self._t1) > self.p
                else (self._t2, self._b2, self._t1, self._b1))
            got = _take(first, 1, can_evict)
            ghost = ghost_first
            if not got:
                got, ghost = _take(second, 1, can_evict), ghost_second
            if not got:
                break
            ghost[got[0]] = None
            out.append(got[0])
        for ghosts in (self._b1, self._b2):
            while len(ghosts) > self.capacity:
                ghosts.popitem(last=False)
        return out
