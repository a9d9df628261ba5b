"""Which chunks the Mooncake pool holds, known without I/O on the manager's thread.

Mooncake Store lists no keys, so the tier's index (`ChunkIndex`) is fed by two sources: the
tier's own stores (added when the put returns) and `batch_is_exist` checks on one background
thread (`Prober`). A lookup of a key the index lacks queues it for the next check and answers
RETRY; once checked, a present key is indexed (HIT) and an absent one stays a MISS for
`refresh_interval_s` (then it is checked again); a check that does not answer within
`timeout_s` is a MISS. Every `sweep_interval_s` the thread re-checks every indexed key: keys
the store evicted, or lost with a restarted master or a dead segment owner, leave the index and
reach `take_removed`; a load that finds its object gone drops it at once (`mark_absent`).

The sweep is rare on purpose: Mooncake's master grants a lease (`default_kv_lease_ttl`, 10 s
by default) on every existence check, and evicts no leased object. A sweep every second (what
this module did, with the negative-cache period) kept every chunk a tier had indexed leased for
good: the pool could evict only chunks younger than one sweep, the newest, and once it missed
them it filled and refused every put (seen in CI: 60 s of NO_AVAILABLE_HANDLE with nothing
read). A sweep leases each chunk for one lease per `sweep_interval_s`, so the interval must be
well above the master's lease (default 300 s: ~3% of the time at the default 10 s lease).
Checks of looked-up keys lease too, as a get does: those chunks are in use.

A listing leases nothing: with the master's HTTP port configured (`master_metrics_address`),
the thread also fetches every object name of the pool (`/get_all_keys`) every
`list_interval_s` and drops the indexed keys it lacks (those indexed before the listing
began), so an eviction reaches `take_removed` within about `list_interval_s` plus one listing
(measured in `tests/tiers/test_mooncake_tier.py`), while the sweep stays rare. A failed
listing proves nothing and drops nothing (`list_errors`).
"""
from __future__ import annotations

import math
import threading
import time
from typing import Any, Callable

from kvhal.keys import ChunkKey

from kvhal.tier import Lookup
from ..index import ChunkIndex

#: Keys per `batch_is_exist` call.
EXIST_BATCH = 1024


class Prober:
    """The background existence checks of one tier (see module docstring). Thread-safe.

    Args:
        index: The tier's index (present keys are added with `nbytes_of(key)` bytes).
        exist: `exist(keys)` → one int per key (1 present, 0 absent, < 0 error): the store's
            `batch_is_exist` on the tier's object names.
        refresh_interval_s: How long an absent key stays a miss.
        sweep_interval_s: Period of the re-checks of every indexed key (module docstring).
        timeout_s: Longest a queued key answers RETRY.
        count: The tier's counter function (`JobBoard.count`).
        list_names: `list_names()` → every object name the pool holds (raises on failure), or
            None for no listings.
        name_of: The object name of a key (with `list_names`).
        list_interval_s: Period of the listings.
    """

    def __init__(self, index: ChunkIndex, exist: Callable[[list[ChunkKey]], list[int]],
                 refresh_interval_s: float, sweep_interval_s: float, timeout_s: float,
                 count: Callable[..., Any],
                 list_names: Callable[[], set[str]] | None = None,
                 name_of: Callable[[ChunkKey], str] | None = None,
                 list_interval_s: float = math.inf):
        self._index, self._exist = index, exist
        self._list_names, self._name_of = list_names, name_of
        self._list_s = list_interval_s if list_names is not None else math.inf
        self._interval, self._sweep_s = refresh_interval_s, sweep_interval_s
        self._timeout_s, self._count = timeout_s, count
        self._cond = threading.Condition()
        self._queued: dict[ChunkKey, float] = {}       # key → deadline of its RETRY answers
        self._absent: dict[ChunkKey, float] = {}       # key → time it may be checked again
        self._marked: dict[ChunkKey, float] = {}       # key → when `mark_absent` last saw it
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvhal-mooncake-probe",
                                        daemon=True)
        self._thread.start()

    def lookup(self, key: ChunkKey) -> Lookup:
        """HIT if indexed; MISS if found absent lately or its check is overdue; else RETRY
        (queued for the next check). No I/O."""
        if key in self._index:
            return Lookup.HIT
        now = time.monotonic()
        with self._cond:
            until = self._absent.get(key)
            if until is not None and until > now:
                return Lookup.MISS
            deadline = self._queued.get(key)
            if deadline is None:
                self._queued[key] = now + self._timeout_s
                self._cond.notify()
                return Lookup.RETRY
            if deadline > now:
                return Lookup.RETRY
            del self._queued[key]
            self._absent[key] = now + self._interval
            self._count("exist_timeouts")
            return Lookup.MISS

    def mark_absent(self, key: ChunkKey, hold: bool = False) -> None:
        """`key` was found missing or corrupt: a MISS for `refresh_interval_s` (then checked
        again; with `hold`, until the next `mark_absent` of it without: its removal is under
        way), and a check already in flight does not index it."""
        now = time.monotonic()
        with self._cond:
            self._absent[key] = math.inf if hold else now + self._interval
            self._marked[key] = now

    def forget_absent(self, keys: list[ChunkKey]) -> None:
        """`keys` were just stored by this tier: no longer remembered absences."""
        with self._cond:
            if self._absent:
                for key in keys:
                    self._absent.pop(key, None)

    def close(self) -> None:
        """Stop the thread (waits for a check in flight, bounded by Mooncake's RPC timeout)."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        next_sweep = time.monotonic() + self._sweep_s
        next_list = time.monotonic() + self._list_s
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or self._queued,
                                    max(0.0, min(next_sweep, next_list) - time.monotonic()))
                if self._stop:
                    return
                keys = list(self._queued)[:EXIST_BATCH]
            if keys:
                self._check(keys)
            if time.monotonic() >= next_list:
                self._list()
                next_list = time.monotonic() + self._list_s
            if time.monotonic() >= next_sweep:
                self._sweep()
                next_sweep = time.monotonic() + self._sweep_s

    def _check(self, keys: list[ChunkKey]) -> None:
        started = time.monotonic()
        answers = self._ask(keys)
        now = time.monotonic()
        with self._cond:   # a key marked absent meanwhile was seen before it went: stays absent
            for i, key in enumerate(keys):
                if answers[i] == 1 and self._marked.get(key, -1.0) < started:
                    self._index.add(key, 0)
                elif answers[i] == 1:
                    answers[i] = 0
            for key, answer in zip(keys, answers):
                self._queued.pop(key, None)
                if answer != 1:
                    self._absent[key] = now + self._interval
            self._absent = {k: t for k, t in self._absent.items() if t > now}
            self._marked = {k: t for k, t in self._marked.items() if t >= started}
        self._count("exist_checked", len(keys))

    def _sweep(self) -> None:
        """Re-check every indexed key; drop the ones the pool no longer holds (an error keeps
        a key: a failed check proves nothing)."""
        held, epoch = self._index.snapshot()
        keys = list(held)
        answers = self._ask(keys)
        self._index.reconcile({k: held[k] for k, a in zip(keys, answers) if a != 0}, epoch)
        self._count("sweeps")

    def _list(self) -> None:
        """Drop the indexed keys the pool's listing lacks (no lease taken)."""
        held, epoch = self._index.snapshot()
        try:
            names = self._list_names()
        except Exception:  # noqa: BLE001 - a failed listing proves nothing
            self._count("list_errors")
            return
        self._index.reconcile({k: n for k, n in held.items() if self._name_of(k) in names},
                              epoch)
        self._count("listings")

    def _ask(self, keys: list[ChunkKey]) -> list[int]:
        answers: list[int] = []
        for i in range(0, len(keys), EXIST_BATCH):
            try:
                part = self._exist(keys[i:i + EXIST_BATCH])
            except Exception:  # noqa: BLE001 - a failed call is an error answer per key
                part = [-1] * len(keys[i:i + EXIST_BATCH])
            answers.extend(part)
        errors = sum(1 for a in answers if a < 0)
        if errors:
            self._count("exist_errors", errors)
        return answers
