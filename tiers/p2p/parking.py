"""Chunks a prefill leg parks for its decoder (`orchestration.py`), on the prefiller.

A prefill leg (`remote_decoder: {kv_request_id: ID}`) opens a record under ID when the tier
hears of the request (`open`), before any chunk. Each chunk of the request's prefix that
reaches the host tier is held under ID (`park`: the host slot is pinned through `hold`, so the
manager neither evicts nor rewrites it) and every waiting fetch of it is woken; a chunk that
could not be held is marked failed. When the request ended and its last store was handed
over, the record is sealed (`seal`): from then on a fetch of a chunk the record does not hold
is refused at once (the prefiller will never store it), so a decoder never waits out its
timeout for it.

A fetch (`wait`) of (ID, key) answers as soon as it can: "held" (the server then pins the
slot once more for the transfer and calls `fetched`), or a refusal: the id was reaped, already
finished or given up (remembered for `RETENTION_S`), the chunk failed, or the record is sealed
without it. While the record is open and the chunk not there, it waits until the fetch's
deadline. An id never seen waits too (legs may come in either order or at once, and a prefill
leg is heard of only when the prefiller's scheduler first sees its request, which on a loaded
host can be many seconds after the decoder's fetch): until the fetch's own deadline, as in
vLLM's tier (whose fetch of any id waits for its session), or at most `arrival_s` when set.

A record ends, releasing every pin, when its decoder fetched every chunk of a sealed record,
when the decoder says it is done (`finish`), when ID is opened again (the orchestrator reused
it: the old chunks are released, the new leg starts afresh), or when no fetch touched it for
`unbound_s` (reaped; ID refused for `RETENTION_S` more: fetches at once, new legs park
nothing). A decoder done with an id no leg opened yet (it gave up waiting, or needed no
chunk) leaves a tombstone: for `RETENTION_S` the late prefill leg parks nothing (its chunks
are not pinned for a reap nobody waits on) and fetches of the id are refused at once. One
thread reaps; `close` releases everything and joins it.

Generations. Every record gets a generation number when it opens (`open`; increasing, from a
random start per instance, so a restarted prefiller's numbers do not meet its old ones), a
served fetch tells the decoder the generation it came from, and the decoder's `done` names
the latest one it fetched from (0: it fetched nothing). A `done` ends a record only if it
names that record's generation, or names none: a late `done` of a previous use of the id
(the orchestrator reused it at once, and the old decoder's `done` arrived after the new leg
opened) finds a newer record and leaves it alone (counted `done_stale`), so the new leg's
decoder still gets its chunks. A `done` naming none keeps vLLM's rule (the decoder is finished
with the id: release what is parked, or tombstone an id not opened yet). Likewise a prefill
leg parks into and seals only the record it opened (`park`, `seal` take its generation): an
old leg still running when its id was opened again neither adds its chunks to the new leg's
record nor seals it when it ends (its stores fail: `REOPENED`).

Locking: the manager calls `open`, `park` and `seal` holding its own lock; `hold` and the
releases take the manager's lock, so they are never called while this module's lock is held.
"""
from __future__ import annotations

import itertools
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from kvhal.keys import ChunkKey

#: Seconds a reaped or finished id stays refused (vLLM: `_REAPED_ID_RETENTION_S`).
RETENTION_S = 60.0
HELD = "held"
#: Refusals of a whole id (`wait`): no chunk of it will come. GIVEN_UP: the decoder's `done`
#: came before any prefill leg opened the id (a tombstone; `open` then parks nothing).
REAPED, FINISHED, GIVEN_UP, UNKNOWN, CLOSED = (
    "kv_request_id reaped", "kv_request_id finished", "kv_request_id given up by its decoder",
    "unknown kv_request_id", "tier closed")
ID_REFUSALS = frozenset({REAPED, FINISHED, GIVEN_UP, UNKNOWN, CLOSED})
#: Why a prefill leg parks nothing more: a newer leg opened its id again.
REOPENED = "kv_request_id opened again by a newer prefill leg"
#: Refusals `open` heeds: the id may not be parked under again until they expire.
_NOT_REOPENED = frozenset({REAPED, GIVEN_UP})
#: Seconds between checks that a waiting fetch's peer is still connected.
ALIVE_CHECK_S = 0.2

Release = Callable[[], None]


@dataclass(slots=True)
class _Record:
    gen: int                # generation (module docstring)
    touched: float
    held: dict[ChunkKey, Release] = field(default_factory=dict)
    failed: set[ChunkKey] = field(default_factory=set)
    fetched: set[ChunkKey] = field(default_factory=set)
    sealed: bool = False
    waiters: int = 0        # fetches waiting on it now: never reaped meanwhile


class Parking:
    """Parked chunks by `kv_request_id` (see module docstring). Thread-safe.

    Args:
        hold: `hold(key)` pins the chunk where it is served from and returns the release
            callable, or None if the chunk cannot be held (not resident, being written).
        unbound_s: Seconds a record lives without a fetch touching it.
        arrival_s: Longest wait of a fetch for an id never seen; None: the fetch's own
            deadline (the decoder's `fetch_wait_s`; vLLM's tier has no separate bound).
        count: `count(name)` bumps a tier counter ("parked_chunks", "park_reaped",
            "park_late": a leg opened after its decoder gave up, "done_stale": a `done` of an
            older generation than the id's record, ...).
        retention_s: Seconds a reaped or finished id stays refused.
    """

    def __init__(self, hold: Callable[[ChunkKey], Release | None], *, unbound_s: float,
                 arrival_s: float | None, count: Callable[[str], None],
                 retention_s: float = RETENTION_S):
        self._hold = hold
        self._unbound_s = unbound_s
        self._arrival_s = arrival_s
        self._retention_s = retention_s
        self._count = count
        self._cond = threading.Condition()
        self._records: dict[str, _Record] = {}
        self._gone: dict[str, tuple[float, str]] = {}  # id -> (refused until, why)
        self._waiting = 0           # fetches waiting in `wait` now
        self._gens = itertools.count(1 + secrets.randbelow(1 << 48))
        self._closed = False
        self._reaper = threading.Thread(target=self._reap_loop, name="kvhal-p2p-reap",
                                        daemon=True)
        self._reaper.start()

    # -- prefill leg (manager's thread) -------------------------------------------------------
    def open(self, kv_id: str) -> tuple[int, str | None]:
        """Start parking under `kv_id` (a live record of it is released first). Returns (the
        new record's generation, None), or (0, why nothing will be parked: `REAPED` or
        `GIVEN_UP`, refused for now; `CLOSED`)."""
        with self._cond:
            refused = self._refused(kv_id, time.monotonic())
            if self._closed or refused in _NOT_REOPENED:
                if refused == GIVEN_UP:
                    self._count("park_late")
                return 0, refused or CLOSED
            self._gone.pop(kv_id, None)
            old = self._records.pop(kv_id, None)
            gen = next(self._gens)
            self._records[kv_id] = _Record(gen, time.monotonic())
            self._cond.notify_all()
        if old is not None:
            self._count("park_reused")
            _release_all(old)
        return gen, None

    def park(self, kv_id: str, gen: int, key: ChunkKey) -> str | None:
        """Hold `key` in `kv_id`'s record of generation `gen` (the one its leg opened);
        returns None, or why not (the chunk is then failed; a newer leg's record of a reused
        id is left alone)."""
        release = self._hold(key)
        with self._cond:
            record = self._records.get(kv_id)
            if record is not None and record.gen != gen:
                why = REOPENED
            elif record is not None and not record.sealed:
                if release is None:
                    record.failed.add(key)
                elif key not in record.held:
                    record.held[key], release = release, None
                    self._count("parked_chunks")
                self._cond.notify_all()
                why = None if key in record.held else "chunk not resident in the host tier"
            else:
                why = self._refused(kv_id, time.monotonic()) or "kv_request_id not open"
        if release is not None:
            release()
        return why

    def seal(self, kv_id: str, gen: int) -> None:
        """The prefill leg that opened `kv_id`'s record of generation `gen` ended: nothing
        more will be parked in it (a newer leg's record of a reused id stays open)."""
        with self._cond:
            record = self._records.get(kv_id)
            if record is None or record.gen != gen:
                return
            record.sealed = True
            done = self._complete(kv_id, record)
            self._cond.notify_all()
        if done is not None:
            _release_all(done)

    # -- decode leg (server threads) ----------------------------------------------------------
    def wait(self, kv_id: str, key: ChunkKey, deadline: float,
             alive: Callable[[], bool] = lambda: True) -> tuple[str, int]:
        """(`HELD`, the record's generation) once `key` is held under `kv_id`, or (why the
        fetch is refused, 0): at once for a reaped, finished or given-up id, a failed chunk
        or a sealed record without it; at `deadline` (monotonic seconds), for an id never
        seen too unless `arrival_s` ends its wait sooner (`UNKNOWN`); within `ALIVE_CHECK_S`
        once `alive()` is False (the fetching peer went away). A record is not reaped while
        a fetch waits on it."""
        arrival = deadline if self._arrival_s is None else min(
            deadline, time.monotonic() + self._arrival_s)
        with self._cond:
            while True:
                if self._closed:
                    return CLOSED, 0
                now = time.monotonic()
                record = self._records.get(kv_id)
                if record is None:
                    why = self._refused(kv_id, now)
                    if why is not None:
                        return why, 0
                    until = arrival
                    if now >= until:
                        return UNKNOWN, 0
                else:
                    record.touched = now
                    if key in record.held:
                        return HELD, record.gen
                    if key in record.failed:
                        return "chunk failed on the prefiller", 0
                    if record.sealed:
                        return "chunk not stored by the prefill", 0
                    until = deadline
                    if now >= until:
                        return "timed out waiting for the chunk", 0
                if not alive():
                    return "fetching peer gone", 0
                if record is not None:
                    record.waiters += 1
                self._waiting += 1
                self._cond.wait(min(until - now, ALIVE_CHECK_S))
                self._waiting -= 1
                if record is not None:
                    record.waiters -= 1

    def fetched(self, kv_id: str, key: ChunkKey, gen: int) -> None:
        """`key` of `kv_id`'s record of generation `gen` was sent; a sealed record whose every
        chunk was sent ends."""
        with self._cond:
            record = self._records.get(kv_id)
            if record is None or record.gen != gen or key not in record.held:
                return
            record.fetched.add(key)
            done = self._complete(kv_id, record)
        if done is not None:
            _release_all(done)

    def finish(self, kv_id: str, gen: int) -> None:
        """The decoder of `kv_id` is done with it (fetched what it needs, or gave up); `gen`
        is the latest generation it fetched from, 0 if none (module docstring). The record
        of generation `gen` (with 0: the id's record) ends. A `gen` the id's record does not
        have is a late `done` of an earlier use: nothing changes (counted `done_stale`). With
        0, an id with no record and no refusal (its prefill leg not opened yet) is
        tombstoned `GIVEN_UP` for `retention_s`; an id already finished or reaped keeps its
        refusal (a `done` after the last fetch does not stop the orchestrator reusing it)."""
        with self._cond:
            now = time.monotonic()
            record = self._records.get(kv_id)
            if gen and (record is None or record.gen != gen):
                self._count("done_stale")
                return
            if record is not None:
                del self._records[kv_id]
                self._gone[kv_id] = (now + self._retention_s, FINISHED)
            elif self._closed or self._refused(kv_id, now) is not None:
                return
            else:
                self._gone[kv_id] = (now + self._retention_s, GIVEN_UP)
            self._cond.notify_all()
        if record is not None:
            _release_all(record)

    # -- bookkeeping -------------------------------------------------------------------------
    def _complete(self, kv_id: str, record: _Record) -> _Record | None:
        if not record.sealed or record.fetched != record.held.keys():
            return None
        if not record.held and not record.failed:
            return None            # nothing parked yet: a fetch may still find out at once
        del self._records[kv_id]
        self._gone[kv_id] = (time.monotonic() + self._retention_s, FINISHED)
        return record

    def _refused(self, kv_id: str, now: float) -> str | None:
        gone = self._gone.get(kv_id)
        if gone is None:
            return None
        if gone[0] <= now:
            del self._gone[kv_id]
            return None
        return gone[1]

    def stats(self) -> dict[str, int]:
        """parked_ids (records), parked_held (chunks pinned now), fetches_waiting (fetches
        waiting now for a chunk or for their id's prefill leg)."""
        with self._cond:
            return {"parked_ids": len(self._records),
                    "parked_held": sum(len(r.held) for r in self._records.values()),
                    "fetches_waiting": self._waiting}

    def _reap_loop(self) -> None:
        period = max(0.01, min(1.0, self._unbound_s / 4))
        while True:
            with self._cond:
                if self._closed:
                    return
                self._cond.wait(period)
                now = time.monotonic()
                expired = [k for k, r in self._records.items()
                           if not r.waiters and now - r.touched >= self._unbound_s]
                reaped = [self._records.pop(k) for k in expired]
                for kv_id in expired:
                    self._gone[kv_id] = (now + self._retention_s, REAPED)
                for kv_id in [k for k, (until, _) in self._gone.items() if until <= now]:
                    del self._gone[kv_id]
                if reaped:
                    self._cond.notify_all()
            for record in reaped:
                self._count("park_reaped")
                _release_all(record)

    def close(self) -> None:
        """Release every parked chunk, wake every fetch, join the reaper. Idempotent."""
        with self._cond:
            self._closed = True
            records, self._records = list(self._records.values()), {}
            self._cond.notify_all()
        for record in records:
            _release_all(record)
        self._reaper.join()


def _release_all(record: _Record) -> None:
    for release in record.held.values():
        release()
    record.held.clear()
