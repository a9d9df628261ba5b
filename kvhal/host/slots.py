"""Slot bookkeeping of the host tier: which chunk lives in which slot, and who uses it.

Slot state (DESIGN §5): `-1` being written (a store or a promotion is filling it), `0` idle
(resident and evictable), `> 0` the number of readers (loads, cascades to secondary tiers,
lookup pins). Eviction only takes idle slots; a slot under I/O is never reused. A chunk dropped
while in use (`discard`) leaves the index at once (lookups miss) and its slot is freed when the
last reader or writer finishes.

Not thread-safe: one owner (the manager) calls it.
"""
from __future__ import annotations

from typing import Hashable, Iterable

from .policy import CachePolicy

WRITING = -1
IDLE = 0


class SlotTable:
    """`capacity` slots, a key index and a cache policy.

    Args:
        capacity: Number of slots (> 0).
        policy: The eviction order (from a registered `PolicySpec` factory).
    """

    def __init__(self, capacity: int, policy: CachePolicy):
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self.policy = policy
        self.state = [IDLE] * capacity
        self.keys: list[Hashable | None] = [None] * capacity
        self.index: dict[Hashable, int] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self._doomed: set[int] = set()

    # -- queries -----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Slots holding no chunk."""
        return len(self._free)

    def num_in_state(self, *, readers: bool = False, writing: bool = False) -> int:
        """Bound slots with readers (state > 0) or being written (state -1)."""
        bound = set(range(self.capacity)) - set(self._free)
        return sum(1 for s in bound if (readers and self.state[s] > 0)
                   or (writing and self.state[s] == WRITING))

    # -- placing chunks ----------------------------------------------------------------------
    def reserve(self, keys: Iterable[Hashable],
                protect: frozenset | set = frozenset()) -> tuple[list[int], list[Hashable]]:
        """Bind `keys` (none of them indexed) to slots in state -1, in order, evicting idle
        chunks not in `protect` as needed; stops at the first key that does not fit.

        Returns:
            (slots, evicted): one slot per placed key (a prefix of `keys`), and the evicted keys.
        """
        slots: list[int] = []
        evicted: list[Hashable] = []
        state, index = self.state, self.index
        for key in keys:
            if not self._free:
                victims = self.policy.evict(1, lambda k: state[index[k]] == IDLE
                                            and k not in protect)
                if not victims:
                    break
                evicted.append(victims[0])
                self._drop(index.pop(victims[0]))
            slot = self._free.pop()
            state[slot] = WRITING
            self.keys[slot] = key
            index[key] = slot
            slots.append(slot)
        return slots, evicted

    def commit(self, slot: int) -> bool:
        """A write into `slot` finished well: state -1 → 0, the policy learns the key.

        Returns:
            False if the chunk was discarded while being written (the slot is freed instead).
        """
        if slot in self._doomed:
            self._doomed.discard(slot)
            self._drop(slot)
            return False
        self.state[slot] = IDLE
        self.policy.insert(self.keys[slot])
        return True

    def abort(self, slot: int) -> None:
        """A write into `slot` failed: unindex its key and free the slot."""
        if slot in self._doomed:
            self._doomed.discard(slot)
        else:
            del self.index[self.keys[slot]]
        self._drop(slot)

    # -- readers -----------------------------------------------------------------------------
    def acquire(self, slot: int) -> None:
        """Add a reader to a resident slot (state ≥ 0)."""
        self.state[slot] += 1

    def release(self, slot: int) -> None:
        """Remove a reader; the slot is freed if it was discarded and this was the last one."""
        self.state[slot] -= 1
        if self.state[slot] == IDLE and slot in self._doomed:
            self._doomed.discard(slot)
            self._drop(slot)

    # -- removal -----------------------------------------------------------------------------
    def discard(self, key: Hashable) -> bool:
        """Drop `key`: at once if idle, else when its readers/writer finish.

        Returns:
            True if the key was indexed.
        """
        slot = self.index.pop(key, None)
        if slot is None:
            return False
        self.policy.remove(key)
        if self.state[slot] == IDLE:
            self._drop(slot)
        else:
            self._doomed.add(slot)
        return True

    def _drop(self, slot: int) -> None:
        self.state[slot] = IDLE
        self.keys[slot] = None
        self._free.append(slot)
