"""The manager (DESIGN §5): decides which chunks are stored, loaded, promoted and evicted.

It never does I/O on the device: it hands out host slots in `StorePlan`s/`LoadPlan`s that the
worker executes, and learns the outcome through `complete_store`/`complete_load`. It submits
secondary-tier jobs (cascades host → tier after each store, promotions tier → host on lookup);
tiers do their I/O on their own threads and the manager collects results in `poll`.

Threading: one thread (the scheduler's) calls every method. A tier given host access
(`SecondaryTier.attach_host`, `access.py`) pins slots from its own threads, so every method
that touches slot state holds `lock` (an uncontended RLock: well under a microsecond per call,
whatever the number of chunks). Every job (store, load, tier job) ends exactly once, as
success or failure, and is announced once to `kvhal_job_finished` hook implementations
(`FinishedJob`; built only while one is registered).
"""
from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections import defaultdict
from typing import Any, Callable, Hashable, Iterable, Mapping, Sequence

import numpy as np

from kvhal import metrics, plugins
from kvhal.config import CostModelConfig
from kvhal.events import HOST_MEDIUM, LOCAL, AllBlocksCleared, BlockRemoved, BlockStored
from kvhal.host.region import HostLayout
from kvhal.host.slots import IDLE, SlotTable
from kvhal.keys import ChunkKey
from kvhal.tier import JobKind, JobResult, Lookup, SecondaryTier, TierJob
from kvhal.tier_metrics import TierMetrics

from .access import ManagerHostAccess
from .cost import CostModel
from .types import EngineError, FinishedJob, LoadPlan, StorePlan

logger = logging.getLogger(__name__)

_HIT, _MISS, _RETRY, _UNDECIDED = Lookup.HIT, Lookup.MISS, Lookup.RETRY, Lookup.UNDECIDED
_HOST = metrics.HOST
#: Owner of a promotion whose request was released before it landed.
_RELEASED = object()
#: Seconds between two warnings about skipped stores (`Manager.skip_store`).
SKIP_WARNING_INTERVAL_S = 60.0


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
        tokens_per_chunk: Tokens per chunk, for the cost model's recompute predictions (None:
            the model has nothing to compare against and every tier hit loads).
        cost_model: The `cost_model` config (`kvhal.engine.cost`; None: the default model).
        layout: The host region's pools (hybrid models: one slot size per KV cache group,
            `slots` cut with the same capacities); None: one pool of `slot_bytes` slots.
        emit_events: Deliver KV events to `kvhal_kv_event` hooks (they also queue for
            `take_events`).
        max_promotions: Host slots promotions may hold at once (None: a quarter of the
            slots, at least min(capacity, 8)): slots being filled from a secondary tier, plus
            promoted chunks pinned for the request that asked until it looks them up again,
            loads them or is released. A lookup beyond the bound answers RETRY without
            starting the promotion (a later lookup starts it), and a promotion whose request
            was released lands at the cold end of the cache policy, so a long queue of
            waiting requests with tier hits cannot flush the host tier's hot chunks.


    Attributes:
        metrics: This engine's figures per tier (`kvhal.metrics.EngineMetrics`).
        tier_labels: The `tier` label of each secondary tier, in order.
        promotions_deferred: Tier hits answered RETRY without a promotion because
            `max_promotions` slots were held.
        describe: `describe(key)` → bytes describing a chunk for routers (the integration's:
            token ids, parent, LoRA), handed to the tiers with each store of the chunk
            (`TierJob.description`) and given back when a tier finds the chunk
            (`BlockStored.descriptions`); None (default): chunks are not described.

    Raises:
        ValueError: `max_promotions` < 1; "cost_model.tiers.<label>: ..." for a configured
            label no tier has.
    """

    def __init__(self, slots: SlotTable, *, slot_bytes: int, chunk_nbytes: int,
                 tiers: Sequence[SecondaryTier] = (), emit_events: bool = True,
                 layout: HostLayout | None = None, max_promotions: int | None = None,
                 tokens_per_chunk: int | None = None, cost_model: CostModelConfig | None = None):
        if max_promotions is not None and max_promotions < 1:
            raise ValueError(f"max_promotions must be ≥ 1, got {max_promotions}")
        self.slots = slots
        self.max_promotions = (max(min(slots.capacity, 8), slots.capacity // 4)
                               if max_promotions is None else max_promotions)
        self.slot_bytes = slot_bytes
        self.chunk_nbytes = chunk_nbytes
        # (byte offset in the host view, payload bytes) of a slot: pools of a layout have
        # their own slot sizes.
        self._span = layout.slot_span if layout is not None else (
            lambda slot: (slot * slot_bytes, chunk_nbytes))
        self._layout = layout
        self.tiers = tuple(tiers)
        #: A tier learned of a change by itself (`SecondaryTier.watch`) since the last `poll`.
        self._tier_changed = False
        #: Called on such a change (any thread; must not block): the integration wakes an
        #: idle engine with it so that the change's event leaves (None: nobody to wake).
        self.on_tier_change: Callable[[], None] | None = None
        for tier in self.tiers:
            tier.watch(self._on_tier_change)
        self._emit = emit_events
        self._ids = itertools.count(1)
        # store job id -> (keys, slots, request id or None)
        self._stores: dict[int, tuple[tuple[ChunkKey, ...], list[int], Hashable | None]] = {}
        # request id -> indices of the tiers that took part (`open_request`)
        self._requests: dict[Hashable, tuple[int, ...]] = {}
        self._closing: set[Hashable] = set()    # closed, waiting for their open stores
        self._loads: dict[int, tuple[tuple[ChunkKey, ...], list[int]]] = {}  # id → keys, slots
        self._pins: dict[Hashable, list[int]] = {}
        # (tier index, tier job id) -> (kind, slot, key, later keys); LOAD = promotion (later:
        # the keys after `key` in the prefix looked up, which a failed load makes the tier
        # forget), STORE = cascade (later: ()).
        self._tier_jobs: dict[tuple[int, int],
                              tuple[JobKind, int, ChunkKey, tuple[ChunkKey, ...]]] = {}
        # Slots held by promotions (in flight, or landed and pinned) -> the request that asked
        # (None: nobody asked; _RELEASED: its request went away, the chunk lands cold).
        self._promo: dict[int, Hashable | None] = {}
        self.promotions_deferred = 0
        # Chunks whose promotion failed: the next lookup of each answers MISS (not a new
        # promotion from a tier that may still claim it), unless it was stored since.
        self._failed_promotions: set[ChunkKey] = set()
        # Chunks in host memory that a store job put there → that job's id (ids only grow,
        # so a job of a larger id started later): a failed promotion of an earlier id must
        # not make a tier forget them (`poll`).
        self._stored_by: dict[ChunkKey, int] = {}
        # Chunks a promotion put into host memory and nobody has loaded since: key → tier.
        self._promoted: dict[ChunkKey, int] = {}
        self._started: dict[int, float] = {}      # host job id → time.monotonic() at prepare
        self._events: list = []
        self._skip_warned_at: float | None = None   # time.monotonic() of the last warning
        self._skipped_unwarned = 0                  # chunks skipped since that warning
        self.tier_labels = metrics.tier_labels([t.name for t in self.tiers])
        # the tiers' own metrics (their declarations checked now), labelled as their tiers
        own = [getattr(tier, "metrics", None) for tier in self.tiers]
        own = [(label, m) for label, m in zip(self.tier_labels, own)
               if isinstance(m, TierMetrics)]
        for label, figures in own:
            figures.label = label
        self.metrics = metrics.EngineMetrics(self.sizes, [m for _, m in own])
        #: Load or recompute, per secondary tier (`kvhal.engine.cost`).
        self.cost = CostModel(cost_model or CostModelConfig(), self.tier_labels,
                              tokens_per_chunk)
        # (request id, first skipped key, tier) of skips already counted: a request asked
        # again step after step counts its skipped tokens once.
        self._skips_counted: dict[tuple, None] = {}
        #: Guards slot state against tiers pinning slots from their threads (`access.py`).
        self.lock = threading.RLock()
        #: `listener(gained, lost)` of tiers that subscribed to host-tier changes.
        self.host_listeners: list = []
        self.describe: Callable[[ChunkKey], bytes | None] | None = None
        if len(slots.capacities) == 1:  # pools of different slot sizes: no shared host access
            access = ManagerHostAccess(self)
            for tier in self.tiers:
                tier.attach_host(access)
        self._announce_found()    # what the tiers hold at start: a restarted instance tells

    # -- lookup ------------------------------------------------------------------------------
    @_locked
    def lookup(self, keys: Sequence[ChunkKey], pin_owner: Hashable | None = None, *,
               request_id: Hashable | None = None) -> list[Lookup]:
        """Where each chunk of a prefix stands: HIT (in host memory now), RETRY (being written
        into host memory: a store in flight or a promotion from a secondary tier; ask again
        later), UNDECIDED (not in host memory and not known yet: a secondary tier is still
        finding out whether it holds it; not a hit, ask again later) or MISS.

        A miss in host memory asks the secondary tiers in order; the first that has the chunk
        starts a promotion into a reserved host slot (never evicting a chunk of `keys`) and the
        answer is RETRY until it lands; a failed promotion answers MISS once. While
        `max_promotions` slots are held by promotions, a tier hit answers RETRY without
        starting one (a later lookup starts it). If no tier has it and one answered RETRY
        (`Lookup`: it cannot tell yet), the answer is UNDECIDED. Keys after the first MISS
        answer MISS without being looked at (a chunk is usable only after its whole prefix).

        Args:
            keys: Chunk keys of one prefix, in order (may be empty).
            pin_owner: If given, every HIT before the first MISS is pinned (not evictable)
                for this owner (a request, or one KV cache group of a request) until
                `prepare_load` or `release(pin_owner)`; a new lookup for the same owner
                replaces its pins. A promotion this lookup starts is pinned for the owner
                when it lands (until its next lookup, `prepare_load` or `release`).
            request_id: The request the lookup serves (`open_request`): tiers that took
                part answer for it (`SecondaryTier.lookup_for`) and see it on its
                promotions (`TierJob.request_id`).

        Returns:
            One answer per key.
        """
        if self._tier_jobs:
            self.poll()
        if pin_owner is not None:
            self._unpin(pin_owner)
        index, state = self.slots.index, self.slots.state
        out: list[Lookup] = []
        pins: list[int] = []
        protect: frozenset | None = None       # the prefix, never evicted for a promotion
        decided: dict[int, bool] = {}          # tier index → load (the cost model, once)
        for i, key in enumerate(keys):
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
            answer = self._promote(keys, i, protect, pin_owner, request_id, decided,
                                   _RETRY not in out)
            out.append(answer)
            if answer is _MISS:
                break
        if len(out) < len(keys):
            out.extend([_MISS] * (len(keys) - len(out)))
        if pin_owner is not None and pins:
            for slot in pins:
                state[slot] += 1
            self._pins[pin_owner] = pins
        retries = out.count(_RETRY) + out.count(_UNDECIDED)    # both: asked again later
        count = self.metrics.count
        count("chunk_lookups", _HOST, len(pins), "hit")
        count("chunk_lookups", _HOST, retries, "retry")
        count("chunk_lookups", _HOST, len(out) - len(pins) - retries, "miss")
        return out

    def _promote(self, keys: Sequence[ChunkKey], i: int, protect: frozenset | None,
                 owner: Hashable | None, request_id: Hashable | None,
                 decided: dict[int, bool], first: bool) -> Lookup:
        """Answer for `keys[i]`, absent from host memory: start its promotion from the first
        tier holding it whose load the cost model expects to pay (`decided`: this lookup's
        decisions so far, by tier index; `first`: nothing of this prefix is on its way yet),
        see `lookup`."""
        key = keys[i]
        if not self.tiers:
            return _MISS
        if key in self._failed_promotions:
            self._failed_promotions.discard(key)
            return _MISS
        answer = _MISS
        taking = self._requests.get(request_id, ()) if request_id is not None else ()
        for t, tier in enumerate(self.tiers):
            found = tier.lookup_for(key, request_id) if t in taking else tier.lookup(key)
            self.metrics.count("chunk_lookups", self.tier_labels[t], 1, found.value)
            if found is _RETRY:
                answer = _UNDECIDED
            elif found is _HIT:
                if not self._worth_loading(t, keys, i, request_id, decided, first):
                    continue
                if len(self._promo) >= self.max_promotions:
                    self.promotions_deferred += 1
                    return _RETRY
                placed, evicted = self.slots.reserve([key], protect)
                self._removed(evicted)
                if not placed:
                    return _MISS
                self._submit_promotion(t, placed[0], key, tuple(keys[i + 1:]), owner,
                                       request_id if t in taking else None)
                return _RETRY
        return answer

    def _submit_promotion(self, t: int, slot: int, key: ChunkKey, later: tuple[ChunkKey, ...],
                          owner: Hashable | None, request_id: Hashable | None) -> None:
        """Promote `key` from tier `t` into the reserved host `slot` for `owner`."""
        job_id = next(self._ids)
        self._promo[slot] = owner
        self._tier_jobs[(t, job_id)] = (JobKind.LOAD, slot, key, later)
        self.cost.started(t)
        self.tiers[t].submit_load(TierJob(job_id, JobKind.LOAD, key, *self._span(slot),
                                          request_id=request_id))

    def _worth_loading(self, t: int, keys: Sequence[ChunkKey], i: int,
                       request_id: Hashable | None, decided: dict[int, bool],
                       first: bool) -> bool:
        """Whether to load `keys[i:]` from tier `t` rather than recompute them (the cost
        model, asked once per tier per lookup). A skip counts the run's tokens once per
        request in `cost_skipped_tokens` and may start a background probe of the tier."""
        load = decided.get(t)
        if load is not None:
            return load
        cost = self.cost
        if not cost.enabled:
            decided[t] = True
            return True
        nbytes = (self._layout.pools[self.slots.pool_of(keys[i])].chunk_nbytes
                  if self._layout is not None else self.chunk_nbytes)
        load = decided[t] = cost.decide(t, len(keys) - i, nbytes, first).load
        if load:
            return True
        counted = (request_id, keys[i], t)
        if counted not in self._skips_counted:
            self._skips_counted[counted] = None
            if len(self._skips_counted) > 4096:
                del self._skips_counted[next(iter(self._skips_counted))]
            self.metrics.count("cost_skipped_tokens", self.tier_labels[t],
                               (len(keys) - i) * cost.tokens_per_chunk)
        if cost.probe_due(t):
            self._probe(t, keys, i)
        return False

    def _probe(self, t: int, keys: Sequence[ChunkKey], i: int) -> None:
        """Re-measure tier `t`: promote the last chunk of `keys[i:]` it holds and host memory
        lacks, owned by nobody (it lands cold; no request waits for it)."""
        index, tier = self.slots.index, self.tiers[t]
        for key in reversed(keys[i:]):
            if key not in index and tier.lookup(key) is _HIT:
                placed, evicted = self.slots.reserve([key], frozenset(keys))
                self._removed(evicted)
                if placed:
                    self._submit_promotion(t, placed[0], key, (), _RELEASED, None)
                return

    @_locked
    def release(self, pin_owner: Hashable) -> None:
        """Drop every lookup pin of `pin_owner` (finished, aborted, preempted or not
        scheduled); its promotions still in flight land unpinned. Idempotent."""
        self._unpin(pin_owner)
        for slot, owner in self._promo.items():
            if owner == pin_owner:
                self._promo[slot] = _RELEASED

    def _unpin(self, pin_owner: Hashable, only: Iterable[int] | None = None) -> None:
        """Drop `pin_owner`'s pins (those on `only`, if given) and stop counting its landed
        promotions against `max_promotions`."""
        pins = self._pins.pop(pin_owner, None)
        if not pins:
            return
        drop = pins
        if only is not None:
            taken = set(only)
            drop = [s for s in pins if s in taken]
            if len(drop) < len(pins):
                self._pins[pin_owner] = [s for s in pins if s not in taken]
        release, promo = self.slots.release, self._promo
        for slot in drop:
            release(slot)
            if slot in promo and promo[slot] == pin_owner:
                del promo[slot]

    # -- stores ------------------------------------------------------------------------------
    @_locked
    def prepare_store(self, keys: Sequence[ChunkKey], request_id: Hashable | None = None
                      ) -> StorePlan | None:
        """Reserve host slots (state -1) for the chunks of `keys` not yet in host memory.

        Eviction takes idle chunks by the cache policy, never a chunk of `keys` (the batch being
        stored) nor one with readers or a writer. Keys are placed in order; if one does not fit,
        it and every later key are skipped (stored keys stay a contiguous prefix).

        Args:
            keys: Chunk keys of one prefix, in order. A key given more than once is stored
                once, at its first position (`StorePlan.indices`).
            request_id: The storing request (`open_request`): its stores cascade to
                the tiers that took part with `TierJob.request_id` set, and its keys already
                readable in host memory are handed to those tiers now (they are the
                request's chunks too).

        Returns:
            The plan, or None if nothing needs storing or nothing fits (no job is created).
        """
        index = self.slots.index
        todo, seen = [], set()
        for i, key in enumerate(keys):
            if key not in index and key not in seen:  # a repeated key is stored once
                seen.add(key)
                todo.append(i)
        self._offer(keys, request_id)
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
        self._stores[job_id] = (placed, slots, request_id)
        self._started[job_id] = time.monotonic()
        return StorePlan(job_id, placed, np.array(todo[:len(slots)], dtype=np.int64),
                         np.array(slots, dtype=np.int64))

    @_locked
    def num_held(self, keys: Sequence[ChunkKey]) -> int:
        """How many of `keys`, from the first on, are in host memory or sure to be: readable,
        or reserved by a store job (`prepare_store` placed them). A chunk a promotion is still
        writing is not held: the promotion may fail, and the computed chunk must then be
        stored. After `prepare_store(keys)` the first key past that prefix is the first one
        that did not fit or is still being promoted."""
        index, state, promo = self.slots.index, self.slots.state, self._promo
        for i, key in enumerate(keys):
            slot = index.get(key)
            if slot is None or (state[slot] < IDLE and slot in promo):
                return i
        return len(keys)

    def skip_store(self, num_chunks: int) -> None:
        """Record `num_chunks` (≥ 0) chunks that were due for storing but never got a host slot
        before their request ended (every `prepare_store` found the host tier's slots busy):
        counted as `skipped_chunks` of the host tier, and a warning, at most once every
        `SKIP_WARNING_INTERVAL_S` seconds, that the host tier (`cpu_bytes_to_use`) is smaller
        than one step's stores."""
        if num_chunks <= 0:
            return
        self.metrics.count("skipped_chunks", _HOST, num_chunks)
        self._skipped_unwarned += num_chunks
        now = time.monotonic()
        if self._skip_warned_at is None or now - self._skip_warned_at >= SKIP_WARNING_INTERVAL_S:
            logger.warning("kvhal: %d chunks due for storing found no free host slot before "
                           "their request ended and were not stored: the host tier (%d slots, "
                           "cpu_bytes_to_use) is smaller than one step's stores",
                           self._skipped_unwarned, self.slots.capacity)
            self._skip_warned_at, self._skipped_unwarned = now, 0

    @_locked
    def complete_store(self, job_id: int, num_ok: int | None = None) -> None:
        """End a store job: its first `num_ok` chunks (None = all) become resident and cascade
        to every secondary tier; the rest are dropped (their slots freed).

        Raises:
            EngineError: `job_id` is not an open store job (unknown or already completed).
        """
        try:
            keys, slots, request_id = self._stores.pop(job_id)
        except KeyError:
            raise EngineError(f"store job {job_id} is not open (unknown or completed)") from None
        n_ok = len(slots) if num_ok is None else max(0, min(num_ok, len(slots)))
        commit, stored = self.slots.commit, []
        for key, slot in zip(keys[:n_ok], slots[:n_ok]):
            if commit(slot):
                stored.append((key, slot))
                self._failed_promotions.discard(key)   # computed anew: nothing to fail
                self._stored_by[key] = job_id
        for slot in slots[n_ok:]:
            self.slots.abort(slot)
        self._job_ended("store", job_id, keys, slots, n_ok)
        if stored:
            self._stored([k for k, _ in stored])
            self._cascade(stored, request_id)
        if request_id in self._closing and not any(c == request_id
                                                   for *_, c in self._stores.values()):
            self._end_request(request_id)

    def _cascade(self, stored: list[tuple[ChunkKey, int]], request_id: Hashable | None = None,
                 only_taking: bool = False) -> None:
        """Submit a store of each (key, slot) to every secondary tier (`only_taking`: to the
        tiers that took part in `request_id` only), with `request_id` for those that took part."""
        taking = self._requests.get(request_id, ()) if request_id is not None else ()
        describe = self.describe
        for t, tier in enumerate(self.tiers):
            if only_taking and t not in taking:
                continue
            request = request_id if t in taking else None
            for key, slot in stored:
                self.slots.acquire(slot)
                job_id = next(self._ids)
                self._tier_jobs[(t, job_id)] = (JobKind.STORE, slot, key, ())
                self.cost.started(t, JobKind.STORE)
                tier.submit_store(TierJob(job_id, JobKind.STORE, key, *self._span(slot),
                                          request_id=request,
                                          description=describe(key) if describe else None))

    # -- requests tiers take part in --------------------------------------------------------
    @_locked
    def offer(self, keys: Sequence[ChunkKey], request_id: Hashable) -> None:
        """Hand the chunks of `keys` readable in host memory to the tiers that took part in
        `request_id`, as stores of the request (`TierJob.request_id`): chunks it loaded rather than
        computed are its chunks too. Nothing for a request no tier took part in."""
        self._offer(keys, request_id)

    def _offer(self, keys: Sequence[ChunkKey], request_id: Hashable | None) -> None:
        if request_id is None or request_id not in self._requests:
            return
        index, state, resident = self.slots.index, self.slots.state, []
        for key in dict.fromkeys(keys):
            slot = index.get(key)
            if slot is not None and state[slot] >= IDLE:
                resident.append((key, slot))
        self._cascade(resident, request_id, only_taking=True)

    @_locked
    def open_request(self, request_id: Hashable, params: Mapping[str, Any]) -> bool:
        """Hand a request's parameters (vLLM: its `kv_transfer_params`) to every secondary
        tier (`SecondaryTier.open_request`); returns True if one took part. Then pass
        `request_id` to `lookup`, `prepare_store` and `sources` for this request, and call
        `close_request` when it ends. Opening an open request again does nothing."""
        if request_id in self._requests:
            return True
        taking = tuple(t for t, tier in enumerate(self.tiers)
                       if tier.open_request(request_id, params))
        if taking:
            self._requests[request_id] = taking
        return bool(taking)

    @_locked
    def close_request(self, request_id: Hashable) -> None:
        """The request of `request_id` is finished: the tiers that took part hear
        `close_request` once its last open store job completed (now if none is open).
        Unknown request ids are ignored; idempotent."""
        if request_id not in self._requests:
            return
        if any(c == request_id for *_, c in self._stores.values()):
            self._closing.add(request_id)
        else:
            self._end_request(request_id)

    def _end_request(self, request_id: Hashable) -> None:
        self._closing.discard(request_id)
        for t in self._requests.pop(request_id):
            self.tiers[t].close_request(request_id)

    # -- loads -------------------------------------------------------------------------------
    @_locked
    def prepare_load(self, keys: Sequence[ChunkKey], pin_owner: Hashable | None = None
                     ) -> LoadPlan | None:
        """Hold the longest prefix of `keys` that is in host memory for reading (readers + 1
        per slot), then drop `pin_owner`'s lookup pins on those slots (pins on later chunks
        stay until its next lookup or `release`).

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
        if pin_owner is not None:
            self._unpin(pin_owner, slots)
        if not slots:
            return None
        job_id = next(self._ids)
        placed = tuple(keys[:len(slots)])
        self._loads[job_id] = (placed, slots)
        self._started[job_id] = time.monotonic()
        labels = self.tier_labels
        sources = tuple(labels[t] if (t := self._promoted.pop(k, None)) is not None else _HOST
                        for k in placed) if self._promoted else (_HOST,) * len(placed)
        return LoadPlan(job_id, placed, np.array(slots, dtype=np.int64), sources)

    @_locked
    def sources(self, keys: Sequence[ChunkKey], request_id: Hashable | None = None
                ) -> tuple[str, ...]:
        """The tier label each chunk of `keys` will be loaded from, as a `LoadPlan.sources`
        would say: the secondary tier promoting it (landed, in flight, or the first tier
        holding it while `max_promotions` defers it; asked for `request_id` as in `lookup`),
        else the host tier. Starts nothing."""
        flying = {key: t for (t, _), (kind, _, key, _) in self._tier_jobs.items()
                  if kind is JobKind.LOAD}
        index, state, labels = self.slots.index, self.slots.state, self.tier_labels
        taking = self._requests.get(request_id, ()) if request_id is not None else ()
        out = []
        for key in keys:
            t = self._promoted.get(key, flying.get(key))
            if t is None and (key not in index or state[index[key]] < IDLE):
                t = next((i for i, tier in enumerate(self.tiers)
                          if (tier.lookup_for(key, request_id) if i in taking
                              else tier.lookup(key)) is _HIT), None)
            out.append(_HOST if t is None else labels[t])
        return tuple(out)

    @_locked
    def complete_load(self, job_id: int, num_ok: int | None = None) -> None:
        """End a load job: release its slots. `num_ok` (None = all) only feeds the metrics: a
        failed H2D leaves the host copy intact.

        Raises:
            EngineError: `job_id` is not an open load job.
        """
        try:
            keys, slots = self._loads.pop(job_id)
        except KeyError:
            raise EngineError(f"load job {job_id} is not open (unknown or completed)") from None
        release = self.slots.release
        for slot in slots:
            release(slot)
        n_ok = len(slots) if num_ok is None else max(0, min(num_ok, len(slots)))
        self._job_ended("load", job_id, keys, slots, n_ok)

    def _job_ended(self, kind: str, job_id: int, keys: tuple[ChunkKey, ...], slots: list[int],
                   n_ok: int) -> None:
        """Count a finished host job of `kind` ("store"/"load") and its latency; announce it."""
        count = self.metrics.count
        if kind == "load":                  # a store's chunks count in `_stored`
            count("loaded_chunks", _HOST, n_ok)
        count(f"{kind}_bytes", _HOST, sum(self._span(s)[1] for s in slots[:n_ok]))
        count("failed_chunks", _HOST, len(slots) - n_ok, kind)
        seconds = time.monotonic() - self._started.pop(job_id)
        self.metrics.observe(f"{kind}_latency_seconds", _HOST, seconds)
        if plugins.job_listeners():
            plugins.emit_job_finished(FinishedJob(_HOST, kind, job_id, keys, n_ok, seconds))

    # -- secondary tiers ---------------------------------------------------------------------
    @_locked
    def poll(self) -> list[JobResult]:
        """Collect finished secondary-tier jobs: a promotion that succeeded makes its chunk a
        HIT; one that failed frees its slot, and its tier forgets the chunk and every later
        chunk of the prefix whose lookup started it (`SecondaryTier.forget`: whatever lost one
        likely took the rest, which would otherwise be promised hits that fail late, and
        stores of them after a recompute write them again), except the later chunks computed
        and stored again while this load was failing (a late failure must not undo their
        cascade); a finished cascade releases its slot. Then collect
        the chunks that left each tier (`take_removed`) as `BlockRemoved` events, after this
        poll's `BlockStored` events. A failed job is logged with its tier and reason (a load:
        warning, the request recomputes; a store: info).

        Returns:
            The tier results collected by this call.
        """
        self._tier_changed = False      # before `take_removed`: a later change is kept
        results: list[JobResult] = []
        landed: dict[int, list[ChunkKey]] = defaultdict(list)  # tier index (-1: host) → keys
        count, observe = self.metrics.count, self.metrics.observe
        announce = plugins.job_listeners()
        for t, tier in enumerate(self.tiers):
            label = self.tier_labels[t]
            for result in tier.get_finished_jobs():
                job = self._tier_jobs.pop((t, result.job_id), None)
                if job is None:
                    continue
                kind, slot, key, later = job
                results.append(result)
                observe(f"{kind.value}_latency_seconds", label, result.seconds)
                if announce:
                    plugins.emit_job_finished(FinishedJob(label, kind.value, result.job_id, (key,),
                                                          int(result.ok), result.seconds,
                                                          result.error))
                if not result.ok:
                    count("failed_chunks", label, 1, kind.value)
                    (logger.warning if kind is JobKind.LOAD else logger.info)(
                        "%s tier: %s of chunk %s failed after %.3f s: %s", label, kind.value,
                        key.block_hash.hex()[:16], result.seconds, result.error)
                if kind is JobKind.LOAD:
                    self.cost.finished(t, self._span(slot)[1], result.seconds, result.ok)
                    owner = self._promo.pop(slot, None)
                    if not result.ok:
                        self.slots.abort(slot)
                        self._failed_promotions.add(key)
                        since = self._stored_by.get     # (computed and stored anew since)
                        tier.forget((key, *(k for k in later
                                            if since(k, 0) < result.job_id)))
                    else:
                        count("loaded_chunks", label)
                        count("load_bytes", label, self._span(slot)[1])
                        if self.slots.commit(slot, cold=owner is _RELEASED):
                            self._promoted[key] = t
                            landed[-1].append(key)
                            if owner is not None and owner is not _RELEASED:   # pinned for it
                                self.slots.acquire(slot)
                                self._pins.setdefault(owner, []).append(slot)
                                self._promo[slot] = owner
                else:
                    self.slots.release(slot)
                    self.cost.finished(t, self._span(slot)[1], result.seconds, result.ok,
                                       JobKind.STORE)
                    if result.ok:
                        count("store_bytes", label, self._span(slot)[1])
                        landed[t].append(key)
        for t, keys in landed.items():
            self._stored(keys, t)
        # after the stores: a chunk a tier stored and then evicted within one poll is gone
        for t, tier in enumerate(self.tiers):
            gone = tier.take_removed()
            if gone:
                self._removed(gone, t)
        self._announce_found()
        return results

    def _announce_found(self) -> None:
        """Announce the chunks each tier found rather than stored (`SecondaryTier.take_found`:
        at start, or by a listing of a store others write), with what the tier kept of each
        one's description."""
        for t, tier in enumerate(self.tiers):
            found = tier.take_found()
            if not found:
                continue
            label, medium, locality = self._where(t)
            by_group: dict[int, list[tuple[bytes, bytes | None]]] = defaultdict(list)
            for key, description in found:
                by_group[key.group].append((key.block_hash, description))
            for group, chunks in by_group.items():
                hashes, descriptions = zip(*chunks)
                self._event(BlockStored(hashes, group, medium, locality, label, descriptions))

    @_locked
    def has_pending_work(self) -> bool:
        """Whether something will change without a new request: a secondary-tier job in
        flight, a change a tier learned by itself and `poll` has not collected, or events not
        yet taken (`take_events`). The integration keeps its engine stepping while this
        holds, so that events leave within a bounded time."""
        return bool(self._tier_jobs or self._events or self._tier_changed)

    def _on_tier_change(self) -> None:
        """A tier's listing added or dropped chunks (`SecondaryTier.watch`; its thread)."""
        self._tier_changed = True
        wake = self.on_tier_change
        if wake is not None:
            wake()

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
        """Drop every chunk from host memory (deferred for chunks in use): counted as
        evictions, announced as one `AllBlocksCleared` of the host medium."""
        keys = list(self.slots.index)
        for listener in self.host_listeners:
            listener((), keys)
        for key in keys:
            self.slots.discard(key)
            self._promoted.pop(key, None)
            self._stored_by.pop(key, None)
        self.metrics.count("evicted_chunks", _HOST, len(keys))
        self._event(AllBlocksCleared(HOST_MEDIUM))

    def take_events(self) -> list:
        """KV events since the last call (BlockStored / BlockRemoved / AllBlocksCleared)."""
        out, self._events = self._events, []
        return out

    def _where(self, t: int) -> tuple[str, str, str]:
        """(tier label, medium, locality) of tier index `t` (-1: the host tier)."""
        if t < 0:
            return _HOST, HOST_MEDIUM, LOCAL
        tier = self.tiers[t]
        return self.tier_labels[t], tier.medium, tier.locality

    def _stored(self, keys: list[ChunkKey], t: int = -1) -> None:
        """Count and announce chunks that became readable in tier `t` (-1: host)."""
        label, medium, locality = self._where(t)
        self.metrics.count("stored_chunks", label, len(keys))
        if t < 0:
            for listener in self.host_listeners:
                listener(keys, ())
        for group, hashes in _by_group(keys).items():
            self._event(BlockStored(hashes, group, medium, locality, label))

    def _removed(self, keys: list[ChunkKey], t: int = -1) -> None:
        """Count and announce chunks that left tier `t` (-1: host)."""
        if keys:
            label, medium, locality = self._where(t)
            self.metrics.count("evicted_chunks", label, len(keys))
            if t < 0:
                for key in keys:
                    self._promoted.pop(key, None)
                    self._stored_by.pop(key, None)
            if t < 0:
                for listener in self.host_listeners:
                    listener((), keys)
            for group, hashes in _by_group(keys).items():
                self._event(BlockRemoved(hashes, group, medium, locality, label))

    def _event(self, event) -> None:
        self._events.append(event)
        if self._emit:
            plugins.emit_kv_event(event)

    # -- introspection -----------------------------------------------------------------------
    def sizes(self) -> dict[str, tuple[int, int]]:
        """(used, capacity) bytes per tier label: the host tier's from its slots (slot bytes of
        the occupied slots, of all slots; each pool's own slot size), a secondary
        tier's from its `stats()` `used_bytes` and `max_bytes` (0 where not given). Thread-safe
        as far as the tiers' `stats()` are (they are: DESIGN §6)."""
        if self._layout is None:
            out = {_HOST: (len(self.slots.index) * self.slot_bytes,
                           self.slots.capacity * self.slot_bytes)}
        else:                   # pools of their own slot sizes (hybrid models)
            pools, slot_pool = self._layout.pools, self.slots.slot_pool
            used = sum(pools[slot_pool[s]].slot_bytes for s in list(self.slots.index.values()))
            out = {_HOST: (used, self._layout.nbytes)}
        for label, tier in zip(self.tier_labels, self.tiers):
            stats = tier.stats()
            out[label] = (int(stats.get("used_bytes", 0)), int(stats.get("max_bytes", 0)))
        return out

    @_locked
    def stats(self) -> dict[str, int]:
        """Counts: resident chunks, free slots, slots with readers / being written, lookup
        pins, open store/load jobs, secondary-tier jobs in flight, slots held by promotions."""
        return {"resident": len(self.slots.index), "free_slots": self.slots.num_free,
                "reading_slots": self.slots.num_in_state(readers=True),
                "writing_slots": self.slots.num_in_state(writing=True),
                "lookup_pins": sum(len(p) for p in self._pins.values()),
                "open_stores": len(self._stores), "open_loads": len(self._loads),
                "tier_jobs": len(self._tier_jobs), "promotion_slots": len(self._promo)}

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
