"""The manager (DESIGN §5): decides which chunks are stored, loaded, promoted and evicted.

It never does I/O on the device: it hands out host slots in `StorePlan`s/`LoadPlan`s that the
worker executes, and learns the outcome through `complete_store`/`complete_load`. It submits
secondary-tier jobs (cascades host → tier after each store, promotions tier → host on lookup);
tiers do their I/O on their own threads and the manager collects results in `poll`.

Threading: one thread (the scheduler's) calls every method. A tier given host access
(`SecondaryTier.attach_host`, `access.py`) pins slots from its own threads, so every method
that touches slot state holds `lock` (an uncontended RLock: well under a microsecond per call,
whatever the number of chunks). Every job (store, load, tier job) ends exactly once, as
success or failure.
"""
from __future__ import annotations

import functools
import itertools
import threading
from collections import defaultdict
from typing import Hashable, Iterable, Sequence

import numpy as np

from kvhal import metrics, plugins
from kvhal.events import HOST_MEDIUM, AllBlocksCleared, BlockRemoved, BlockStored
from kvhal.host.region import HostLayout
from kvhal.host.slots import IDLE, SlotTable
from kvhal.keys import ChunkKey
from kvhal.tiers.base import JobKind, JobResult, Lookup, SecondaryTier, TierJob

from .access import ManagerHostAccess
from .types import EngineError, LoadPlan, StorePlan

_HIT, _MISS, _RETRY = Lookup.HIT, Lookup.MISS, Lookup.RETRY
_LOOKUP = {answer: metrics.LOOKUP_CHUNKS.labels(metrics.HOST, answer.value) for answer in Lookup}
_HOST_STORED = metrics.STORED_CHUNKS.labels(metrics.HOST)
_HOST_LOADED = metrics.LOADED_CHUNKS.labels(metrics.HOST)
_HOST_EVICTED = metrics.EVICTED_CHUNKS.labels(metrics.HOST)


def _locked(method):
    """Run `method` holding the manager's lock (see the module docstring)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)
    return run


class Manager:
    """Host-tier bookkeeping plus secondary-tier cascade and promotion.

    Args:
        slots: The host tier's slot table (capacity and eviction policy).
        slot_bytes: Bytes per host slot (offset of slot s is `s * slot_bytes`).
        chunk_nbytes: Payload bytes per chunk (≤ slot_bytes).
        tiers: Secondary tiers, fastest first; every stored chunk cascades to all of them and
            a lookup miss in the host asks them in order.
        layout: The host region's pools (hybrid models: one slot size per KV cache group,
            `slots` cut with the same capacities); None: one pool of `slot_bytes` slots.
        emit_events: Deliver KV events to `kvhal_kv_event` hooks (they also queue for
            `take_events`).
    """

    def __init__(self, slots: SlotTable, *, slot_bytes: int, chunk_nbytes: int,
                 tiers: Sequence[SecondaryTier] = (), emit_events: bool = True,
                 layout: HostLayout | None = None):
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.chunk_nbytes = chunk_nbytes
        # (byte offset in the host view, payload bytes) of a slot: pools of a layout have
        # their own slot sizes.
        self._span = layout.slot_span if layout is not None else (
            lambda slot: (slot * slot_bytes, chunk_nbytes))
        self.tiers = tuple(tiers)
        self._emit = emit_events
        self._ids = itertools.count(1)
        self._stores: dict[int, tuple[tuple[ChunkKey, ...], list[int]]] = {}
        self._loads: dict[int, list[int]] = {}
        self._pins: dict[Hashable, list[int]] = {}
        # (tier index, tier job id) -> (kind, slot, key); LOAD = promotion, STORE = cascade.
        self._tier_jobs: dict[tuple[int, int], tuple[JobKind, int, ChunkKey]] = {}
        self._failed_promotions: set[ChunkKey] = set()
        self._events: list = []
        #: Guards slot state against tiers pinning slots from their threads (`access.py`).
        self.lock = threading.RLock()
        #: `listener(gained, lost)` of tiers that subscribed to host-tier changes.
        self.host_listeners: list = []
        if len(slots.capacities) == 1:  # pools of different slot sizes: no shared host access
            access = ManagerHostAccess(self)
            for tier in self.tiers:
                tier.attach_host(access)

    # -- lookup ------------------------------------------------------------------------------
    @_locked
    def lookup(self, keys: Sequence[ChunkKey], request_id: Hashable | None = None
               ) -> list[Lookup]:
        """Where each chunk of a prefix stands: HIT (in host memory now), RETRY (being written
        into host memory: a store in flight or a promotion from a secondary tier; ask again
        later) or MISS.

        A miss in host memory asks the secondary tiers in order; the first that has the chunk
        starts a promotion into a reserved host slot (never evicting a chunk of `keys`) and the
        answer is RETRY until it lands; a failed promotion answers MISS once. Keys after the
        first MISS answer MISS without being looked at (a chunk is usable only after its whole
        prefix).

        Args:
            keys: Chunk keys of one prefix, in order (may be empty).
            request_id: If given, every HIT before the first MISS is pinned (not evictable)
                for this request until `prepare_load` or `release(request_id)`; a new lookup
                for the same request replaces its pins.

        Returns:
            One answer per key.
        """
        if self._tier_jobs:
            self.poll()
        if request_id is not None:
            self.release(request_id)
        index, state = self.slots.index, self.slots.state
        out: list[Lookup] = []
        pins: list[int] = []
        protect: frozenset | None = None       # the prefix, never evicted for a promotion
        for key in keys:
            slot = index.get(key)
            if slot is not None:
                if state[slot] >= IDLE:
                    out.append(_HIT)
                    pins.append(slot)
                else:
                    out.append(_RETRY)
                continue
            if protect is None and self.tiers:
                protect = frozenset(keys)
            answer = self._promote(key, protect)
            out.append(answer)
            if answer is _MISS:
                break
        if len(out) < len(keys):
            out.extend([_MISS] * (len(keys) - len(out)))
        if request_id is not None and pins:
            for slot in pins:
                state[slot] += 1
            self._pins[request_id] = pins
        retries = out.count(_RETRY)
        for answer, count in ((_HIT, len(pins)), (_RETRY, retries),
                              (_MISS, len(out) - len(pins) - retries)):
            if count:
                _LOOKUP[answer].inc(count)
        return out

    def _promote(self, key: ChunkKey, protect: frozenset | None) -> Lookup:
        if not self.tiers:
            return _MISS
        if key in self._failed_promotions:
            self._failed_promotions.discard(key)
            return _MISS
        answer = _MISS
        for t, tier in enumerate(self.tiers):
            found = tier.lookup(key)
            if found is _RETRY:
                answer = _RETRY
            elif found is _HIT:
                placed, evicted = self.slots.reserve([key], protect)
                self._removed(evicted)
                if not placed:
                    return _MISS
                job_id = next(self._ids)
                self._tier_jobs[(t, job_id)] = (JobKind.LOAD, placed[0], key)
                tier.submit_load(TierJob(job_id, JobKind.LOAD, key, *self._span(placed[0])))
                return _RETRY
        return answer

    @_locked
    def release(self, request_id: Hashable) -> None:
        """Drop every lookup pin of `request_id` (finished, aborted or preempted). Idempotent."""
        pins = self._pins.pop(request_id, None)
        if pins:
            release = self.slots.release
            for slot in pins:
                release(slot)

    # -- stores ------------------------------------------------------------------------------
    @_locked
    def prepare_store(self, keys: Sequence[ChunkKey]) -> StorePlan | None:
        """Reserve host slots (state -1) for the chunks of `keys` not yet in host memory.

        Eviction takes idle chunks by the cache policy, never a chunk of `keys` (the batch being
        stored) nor one with readers or a writer. Keys are placed in order; if one does not fit,
        it and every later key are skipped (stored keys stay a contiguous prefix).

        Args:
            keys: Chunk keys of one prefix, in order. A key given more than once is stored
                once, at its first position (`StorePlan.indices`).

        Returns:
            The plan, or None if nothing needs storing or nothing fits (no job is created).
        """
        index = self.slots.index
        todo, seen = [], set()
        for i, key in enumerate(keys):
            if key not in index and key not in seen:  # a repeated key is stored once
                seen.add(key)
                todo.append(i)
        if not todo:
            return None
        pools = {self.slots.pool_of(keys[i]) for i in todo}
        protect = (frozenset(keys) if any(sum(self.slots.pool_of(keys[i]) == p for i in todo)
                                          > self.slots.num_free_in(p) for p in pools)
                   else frozenset())
        slots, evicted = self.slots.reserve([keys[i] for i in todo], protect)
        self._removed(evicted)
        if not slots:
            return None
        job_id = next(self._ids)
        placed = tuple(keys[i] for i in todo[:len(slots)])
        self._stores[job_id] = (placed, slots)
        return StorePlan(job_id, placed, np.array(todo[:len(slots)], dtype=np.int64),
                         np.array(slots, dtype=np.int64))

    @_locked
    def complete_store(self, job_id: int, num_ok: int | None = None) -> None:
        """End a store job: its first `num_ok` chunks (None = all) become resident and cascade
        to every secondary tier; the rest are dropped (their slots freed).

        Raises:
            EngineError: `job_id` is not an open store job (unknown or already completed).
        """
        try:
            keys, slots = self._stores.pop(job_id)
        except KeyError:
            raise EngineError(f"store job {job_id} is not open (unknown or completed)") from None
        n_ok = len(slots) if num_ok is None else max(0, min(num_ok, len(slots)))
        commit, stored = self.slots.commit, []
        for key, slot in zip(keys[:n_ok], slots[:n_ok]):
            if commit(slot):
                stored.append((key, slot))
        for slot in slots[n_ok:]:
            self.slots.abort(slot)
        if n_ok < len(slots):
            metrics.FAILED_CHUNKS.labels(metrics.HOST, "store").inc(len(slots) - n_ok)
        if stored:
            self._stored([k for k, _ in stored])
            self._cascade(stored)

    def _cascade(self, stored: list[tuple[ChunkKey, int]]) -> None:
        for t, tier in enumerate(self.tiers):
            for key, slot in stored:
                self.slots.acquire(slot)
                job_id = next(self._ids)
                self._tier_jobs[(t, job_id)] = (JobKind.STORE, slot, key)
                tier.submit_store(TierJob(job_id, JobKind.STORE, key, *self._span(slot)))

    # -- loads -------------------------------------------------------------------------------
    @_locked
    def prepare_load(self, keys: Sequence[ChunkKey], request_id: Hashable | None = None
                     ) -> LoadPlan | None:
        """Hold the longest prefix of `keys` that is in host memory for reading (readers + 1
        per slot), then drop `request_id`'s lookup pins.

        Returns:
            The plan (its keys may be fewer than asked if a chunk is not resident), or None if
            the first chunk is not resident (no job is created).
        """
        index, state, touch = self.slots.index, self.slots.state, self.slots.touch
        slots: list[int] = []
        for key in keys:
            slot = index.get(key)
            if slot is None or state[slot] < IDLE:
                break
            state[slot] += 1
            touch(key)
            slots.append(slot)
        if request_id is not None:
            self.release(request_id)
        if not slots:
            return None
        job_id = next(self._ids)
        self._loads[job_id] = slots
        return LoadPlan(job_id, tuple(keys[:len(slots)]), np.array(slots, dtype=np.int64))

    @_locked
    def complete_load(self, job_id: int, num_ok: int | None = None) -> None:
        """End a load job: release its slots. `num_ok` (None = all) only feeds the metrics: a
        failed H2D leaves the host copy intact.

        Raises:
            EngineError: `job_id` is not an open load job.
        """
        try:
            slots = self._loads.pop(job_id)
        except KeyError:
            raise EngineError(f"load job {job_id} is not open (unknown or completed)") from None
        release = self.slots.release
        for slot in slots:
            release(slot)
        n_ok = len(slots) if num_ok is None else max(0, min(num_ok, len(slots)))
        _HOST_LOADED.inc(n_ok)
        if n_ok < len(slots):
            metrics.FAILED_CHUNKS.labels(metrics.HOST, "load").inc(len(slots) - n_ok)

    # -- secondary tiers ---------------------------------------------------------------------
    @_locked
    def poll(self) -> list[JobResult]:
        """Collect finished secondary-tier jobs: a promotion that succeeded makes its chunk a
        HIT, one that failed frees its slot; a finished cascade releases its slot.

        Returns:
            The tier results collected by this call.
        """
        results: list[JobResult] = []
        landed: dict[tuple[int, str], list[ChunkKey]] = defaultdict(list)  # (index, tier)
        for t, tier in enumerate(self.tiers):
            for result in tier.get_finished_jobs():
                job = self._tier_jobs.pop((t, result.job_id), None)
                if job is None:
                    continue
                kind, slot, key = job
                results.append(result)
                if not result.ok:
                    metrics.FAILED_CHUNKS.labels(tier.name, kind.value).inc()
                if kind is JobKind.LOAD:
                    if not result.ok:
                        self.slots.abort(slot)
                        self._failed_promotions.add(key)
                    else:
                        metrics.LOADED_CHUNKS.labels(tier.name).inc()
                        if self.slots.commit(slot):
                            landed[(-1, metrics.HOST)].append(key)
                else:
                    self.slots.release(slot)
                    if result.ok:
                        landed[(t, tier.name)].append(key)
        for (_, name), keys in landed.items():
            self._stored(keys, name)
        return results

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait for every secondary-tier job, then `poll`.

        Raises:
            TimeoutError: a tier still has jobs after `timeout_s` seconds.
        """
        for tier in self.tiers:
            tier.drain(timeout_s)
        self.poll()

    # -- removal and events ------------------------------------------------------------------
    @_locked
    def discard(self, keys: Iterable[ChunkKey]) -> None:
        """Drop chunks from host memory (now if idle, else when their readers finish)."""
        gone = [key for key in keys if self.slots.discard(key)]
        self._removed(gone)

    @_locked
    def clear(self) -> None:
        """Drop every chunk from host memory (deferred for chunks in use)."""
        for listener in self.host_listeners:
            listener((), list(self.slots.index))
        for key in list(self.slots.index):
            self.slots.discard(key)
        self._event(AllBlocksCleared(HOST_MEDIUM))

    def take_events(self) -> list:
        """KV events since the last call (BlockStored / BlockRemoved / AllBlocksCleared)."""
        out, self._events = self._events, []
        return out

    def _stored(self, keys: list[ChunkKey], tier: str = metrics.HOST) -> None:
        """Count and announce chunks that became readable in `tier` ("host" or a tier name)."""
        if tier == metrics.HOST:
            _HOST_STORED.inc(len(keys))
            medium = HOST_MEDIUM
            for listener in self.host_listeners:
                listener(keys, ())
        else:
            metrics.STORED_CHUNKS.labels(tier).inc(len(keys))
            medium = tier.upper()
        for group, hashes in _by_group(keys).items():
            self._event(BlockStored(hashes, group, medium))

    def _removed(self, keys: list[ChunkKey]) -> None:
        """Count and announce chunks that left the host tier."""
        if keys:
            _HOST_EVICTED.inc(len(keys))
            for listener in self.host_listeners:
                listener((), keys)
            for group, hashes in _by_group(keys).items():
                self._event(BlockRemoved(hashes, group, HOST_MEDIUM))

    def _event(self, event) -> None:
        self._events.append(event)
        if self._emit:
            plugins.emit_kv_event(event)

    # -- introspection -----------------------------------------------------------------------
    @_locked
    def stats(self) -> dict[str, int]:
        """Counts: resident chunks, free slots, slots with readers / being written, lookup
        pins, open store/load jobs, secondary-tier jobs in flight."""
        return {"resident": len(self.slots.index), "free_slots": self.slots.num_free,
                "reading_slots": self.slots.num_in_state(readers=True),
                "writing_slots": self.slots.num_in_state(writing=True),
                "lookup_pins": sum(len(p) for p in self._pins.values()),
                "open_stores": len(self._stores), "open_loads": len(self._loads),
                "tier_jobs": len(self._tier_jobs)}

    def close(self) -> None:
        """Drain and close every secondary tier."""
        self.drain()
        for tier in self.tiers:
            tier.close()


def _by_group(keys: list[ChunkKey]) -> dict[int, tuple[bytes, ...]]:
    groups: dict[int, list[bytes]] = defaultdict(list)
    for key in keys:
        groups[key.group].append(key.block_hash)
    return {g: tuple(h) for g, h in groups.items()}
