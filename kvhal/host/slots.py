"""Slot bookkeeping of the host tier: which chunk lives in which slot, and who uses it.

Slot state (DESIGN §5): `-1` being written (a store or a promotion is filling it), `0` idle
(resident and evictable), `> 0` the number of readers (loads, cascades to secondary tiers,
lookup pins). Eviction only takes idle slots; a slot under I/O is never reused. A chunk dropped
while in use (`discard`) leaves the index at once (lookups miss) and its slot is freed when the
last reader or writer finishes.

Slots may be cut into pools (one per KV cache group of a hybrid model, each with its own slot
size): slot ids are global, pool p owns ids `[first_slot(p), first_slot(p) + capacities[p])`,
a key lives in the pool `pool_of(key)` names, and eviction only takes a victim of that pool
under that pool's policy. One pool is the plain case.

Not thread-safe: one owner (the manager) calls it.
"""
from __future__ import annotations

from typing import Callable, Hashable, Iterable, Sequence

from .policy import CachePolicy

WRITING = -1
IDLE = 0


class SlotTable:
    """Slots in one or more pools, a key index and a cache policy per pool.

    Args:
        capacity: Number of slots (> 0), or one count per pool (each > 0).
        policy: The eviction order (from a registered `PolicySpec` factory), or one per pool.
        pool_of: Pool index of a key (called once per key placed); None: every key in pool 0.

    Attributes:
        capacity: Slots over all pools. capacities, policies: per pool; `policy` is pool 0's.
        first_slots: Global id of each pool's first slot. slot_pool: pool of each slot id.
        state, keys, index: Per-slot state and key, and key → slot (all pools).

    Raises:
        ValueError: a capacity ≤ 0, or capacities and policies of different lengths.
    """

    def __init__(self, capacity: int | Sequence[int], policy: CachePolicy | Sequence[CachePolicy],
                 pool_of: Callable[[Hashable], int] | None = None):
        capacities = (capacity,) if isinstance(capacity, int) else tuple(capacity)
        policies = tuple(policy) if isinstance(policy, (list, tuple)) else (policy,)
        if not capacities or any(c <= 0 for c in capacities):
            raise ValueError(f"capacity must be > 0 per pool, got {capacity}")
        if len(policies) != len(capacities):
            raise ValueError(f"{len(policies)} policies for {len(capacities)} pools")
        self.capacity = sum(capacities)
        self.capacities = capacities
        self.policies = policies
        self.policy = policies[0]
        self._pool_of = pool_of or (lambda key: 0)
        starts = [sum(capacities[:p]) for p in range(len(capacities))]
        self.first_slots = tuple(starts)
        self.slot_pool = [p for p, c in enumerate(capacities) for _ in range(c)]
        self.state = [IDLE] * self.capacity
        self.keys: list[Hashable | None] = [None] * self.capacity
        self.index: dict[Hashable, int] = {}
        self._free = [list(range(s + c - 1, s - 1, -1)) for s, c in zip(starts, capacities)]
        self._doomed: set[int] = set()

    # -- queries -----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Slots holding no chunk (all pools)."""
        return sum(len(f) for f in self._free)

    def num_free_in(self, pool: int) -> int:
        """Slots of pool `pool` holding no chunk."""
        return len(self._free[pool])

    def pool_of(self, key: Hashable) -> int:
        """The pool `key` lives in."""
        return self._pool_of(key)

    def num_in_state(self, *, readers: bool = False, writing: bool = False) -> int:
        """Bound slots with readers (state > 0) or being written (state -1)."""
        bound = set(range(self.capacity)).difference(*self._free)
        return sum(1 for s in bound if (readers and self.state[s] > 0)
                   or (writing and self.state[s] == WRITING))

    # -- placing chunks ----------------------------------------------------------------------
    def reserve(self, keys: Iterable[Hashable],
                protect: frozenset | set = frozenset()) -> tuple[list[int], list[Hashable]]:
        """Bind `keys` (none of them indexed) to slots of their pools in state -1, in order,
        evicting idle chunks of the same pool not in `protect` as needed; stops at the first
        key that does not fit.

        Returns:
            (slots, evicted): one slot per placed key (a prefix of `keys`), and the evicted keys.
        """
        slots: list[int] = []
        evicted: list[Hashable] = []
        state, index = self.state, self.index
        for key in keys:
            pool = self._pool_of(key)
            free = self._free[pool]
            if not free:
                victims = self.policies[pool].evict(1, lambda k: state[index[k]] == IDLE
                                                    and k not in protect)
                if not victims:
                    break
                evicted.append(victims[0])
                self._drop(index.pop(victims[0]))
            slot = free.pop()
            state[slot] = WRITING
            self.keys[slot] = key
            index[key] = slot
            slots.append(slot)
        return slots, evicted

    def commit(self, slot: int, cold: bool = False) -> bool:
        """A write into `slot` finished well: state -1 → 0, the policy learns the key (at
        its cold end, first in line for eviction, if `cold`).

        Returns:
            False if the chunk was discarded while being written (the slot is freed instead).
        """
        if slot in self._doomed:
            self._doomed.discard(slot)
            self._drop(slot)
            return False
        self.state[slot] = IDLE
        policy = self.policies[self.slot_pool[slot]]
        if cold:
            policy.insert(self.keys[slot], cold=True)
        else:
            policy.insert(self.keys[slot])
        return True

    def touch(self, key: Hashable) -> None:
        """`key` was used (a hit or a load): its pool's policy learns it."""
        self.policies[self._pool_of(key)].touch(key)

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
        self.policies[self.slot_pool[slot]].remove(key)
        if self.state[slot] == IDLE:
            self._drop(slot)
        else:
            self._doomed.add(slot)
        return True

    def _drop(self, slot: int) -> None:
        self.state[slot] = IDLE
        self.keys[slot] = None
        self._free[self.slot_pool[slot]].append(slot)
