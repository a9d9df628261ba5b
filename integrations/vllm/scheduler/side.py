"""`SchedulerSide`: vLLM's scheduler hooks, routed to the pieces that decide (package
docstring), and the step's metadata for the workers."""
from __future__ import annotations

import time
from typing import Any

from kvhal import plugins
from kvhal.config import EngineConfig, host_tail_bytes
from kvhal.engine import build_manager
from kvhal.host import HostLayout, HostRegion, host_layout

from ..events import ChunkEvents, GroupSpec
from ..geometry import Deployment, check_shareable
from ..lifetime import exit_with_parent, on_shutdown_signal
from ..metadata import KVHalMetadata, KVHalWorkerMetadata, RegionInfo
from ..wake import engine_waker
from .counters import SideCounters, timeline
from .jobs import InFlightJobs, Job
from .loads import LoadPlanner
from .lookup import HitLookup
from .requests import RequestTable, VllmBlocks
from .stores import StorePlanner

#: Shared host regions are anonymous memory files named `kvhal-<engine id>` (`/memfd:kvhal-...`
#: in `/proc/<pid>/fd`); nothing is created in `/dev/shm`, so no signal can leak one.
REGION_NAME_PREFIX = "kvhal-"

#: Seconds the first step in a row with nothing to compute waits for a transfer in flight
#: (`IdleWait`); each further such step waits twice as long, up to `IDLE_WAIT_MAX_S`.
IDLE_WAIT_S = 0.0005
IDLE_WAIT_MAX_S = 0.008


class IdleWait:
    """A step with nothing to compute whose only work is a transfer in flight, or a lookup a
    tier is still deciding (`get_num_new_matched_tokens` answered None), waits a moment
    instead of spinning (vLLM's engine loop calls `schedule` again at once, and each empty
    step also runs the workers): `IDLE_WAIT_S`, doubled for each such step in a row up to
    `IDLE_WAIT_MAX_S`, and back to `IDLE_WAIT_S` once a step computes or an asynchronous load
    ships chunks (`reset`). A short load (a promotion from a local tier) is seen within a
    fraction of a millisecond; a decode leg waiting seconds for its prefiller no longer runs
    ~2,700 lookups/s (a 0.5 ms wait). Each step still reaches the workers, whose queue readers
    would spin between such steps: `spin.bound_reader_spin` keeps them asleep. Adds at most
    `IDLE_WAIT_MAX_S` to noticing a chunk or a new request during a long wait."""

    def __init__(self) -> None:
        self.idle_steps = 0        # steps in a row that waited

    def after_step(self, num_scheduled_tokens: int, waiting: bool) -> None:
        """Wait if the step schedules no token while `waiting` (a transfer in flight or a
        lookup being decided); otherwise start the waits over."""
        if num_scheduled_tokens == 0 and waiting:
            time.sleep(min(IDLE_WAIT_S * 2 ** self.idle_steps, IDLE_WAIT_MAX_S))
            self.idle_steps = min(self.idle_steps + 1, 16)
        else:
            self.idle_steps = 0

    def reset(self) -> None:
        """Chunks are landing: the next idle step waits briefly."""
        self.idle_steps = 0


class SchedulerSide:
    """Scheduler-side state of one `KVHalConnector` (see the package docstring).

    Args:
        deployment: Geometry and namespace (`geometry.deployment`).
        config: The validated `kv_connector_extra_config`.
        engine_id: vLLM's `kv_transfer_config.engine_id` (names the shared host region).
        namespace: 16-byte namespace of the engine's chunks (`identity.cache_namespace`).
        kv_events: Whether vLLM publishes KV events (`kv_events_config.enable_kv_cache_events`);
            chunks are described for them only then.
        data_parallel_index: This engine's data-parallel index (vLLM's
            `parallel_config.data_parallel_index`), for the tiers that take it
            (`kvhal.config.build_tiers`: p2p listens on its `port` + it).
        group_specs: `events.group_specs` of vLLM's KV cache config (for the events).

    Attributes:
        kv_cache_manager: vLLM's `KVCacheManager` (a request's block ids), set by the connector
            when vLLM binds it.
        null_block_id: vLLM's null block (the stand-in for blocks a sliding window dropped),
            set on bind.

    Raises:
        kvhal.config.ConfigError: a secondary tier cannot be built, or secondary tiers are
            configured while vLLM's block hashes are per-process (`check_shareable`).
        kvhal.host.HostRegionError: the shared host region cannot be created.
    """

    def __init__(self, deployment: Deployment, config: EngineConfig, engine_id: str,
                 namespace: bytes, kv_events: bool = False, data_parallel_index: int = 0,
                 group_specs: dict[int, GroupSpec] | None = None):
        check_shareable(deployment, len(config.secondary_tiers))
        self.deployment = deployment
        layout = host_layout(deployment.chunk_nbytes, config.cpu_bytes_to_use,
                             config.slot_shares(g.kind for g in deployment.groups),
                             host_tail_bytes(config))
        exit_with_parent()  # a killed API server must not leave this engine holding the region
        self.region = HostRegion.create_shared(plugins.select_backend("cpu"), layout,
                                               f"{REGION_NAME_PREFIX}{engine_id}")
        self.manager = manager = build_manager(config, layout, self.region.view, namespace,
                                               data_parallel_index=data_parallel_index,
                                               tokens_per_chunk=deployment.tokens_per_chunk)
        manager.metrics.keep_samples = True       # shipped each step (`stats.py`)
        self.chunk_events = (ChunkEvents(deployment.block_size, deployment.blocks_per_chunk,
                                         sum(layout.capacities), group_specs)
                             if kv_events else None)
        if self.chunk_events is not None:   # kept beside the chunk by the tiers that can
            manager.describe = self.chunk_events.describe
            manager.on_tier_change = engine_waker()   # a listing's news leaves while idle
        self._blocks = VllmBlocks()
        self.requests = RequestTable(deployment, config, namespace, manager)
        self.counters = SideCounters(len(deployment.groups))
        self.jobs = InFlightJobs(deployment.tp_size)
        self.lookup = HitLookup(deployment, manager, self.requests, self.chunk_events)
        self.loads = LoadPlanner(deployment, manager, self.requests, self.lookup, self.jobs,
                                 self.counters, self._blocks)
        self.stores = StorePlanner(deployment, config, manager, self.requests, self.jobs,
                                   self.counters, self._blocks, self.chunk_events)
        self._idle = IdleWait()
        self._stop_signalled = False    # vLLM's engine core was told to stop
        self._tiers_closed = False
        on_shutdown_signal(self._on_stop_signal)

    @property
    def layout(self) -> HostLayout:
        """The host region's layout (pools, slots)."""
        return self.region.geometry

    @property
    def namespace(self) -> bytes:
        """16-byte namespace of the engine's chunks."""
        return self.requests.namespace

    @property
    def kv_cache_manager(self) -> Any:
        return self._blocks.kv_cache_manager

    @kv_cache_manager.setter
    def kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._blocks.kv_cache_manager = kv_cache_manager

    @property
    def null_block_id(self) -> int:
        return self._blocks.null_block_id

    @null_block_id.setter
    def null_block_id(self, block_id: int) -> None:
        self._blocks.null_block_id = block_id

    # -- vLLM scheduler hooks ----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Tokens beyond `num_computed_tokens` kvhal can load and whether the load is
        asynchronous (`HitLookup.get_num_new_matched_tokens`)."""
        return self.lookup.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int
                                 ) -> None:
        """Queue the load of the hit chunks into the blocks vLLM allocated
        (`LoadPlanner.update_state_after_alloc`)."""
        self.loads.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVHalMetadata:
        """This step's loads (synchronous ones queued by `update_state_after_alloc`, chunks of
        asynchronous ones that landed), stores (the full chunks due: this step's, and earlier
        ones that found no free host slot then; those `request_finished` placed), preemption
        flush and delayed-free reports. Requests looked up but not scheduled this step hold
        no pins afterwards."""
        stores, report_sending = self.stores.take_pending()
        self.lookup.steps.scheduled(scheduler_output.total_num_scheduled_tokens)
        scheduled = scheduler_output.num_scheduled_tokens
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for request_id, num_scheduled in scheduled.items():
            state = self.requests.get(request_id)
            if state is None:
                continue
            reads = self.loads.sync_reads(request_id)
            if reads is None:   # computed on a block whose load already failed: store nothing
                continue
            jobs, _ = self.stores.plan(state, computed[request_id],
                                       computed[request_id] + num_scheduled)
            for job in jobs:
                self.jobs.read_sync_loads(job.job_id, reads)
            stores.extend(jobs)
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        for request_id, entries in (getattr(block_state, "boundary_state_offloads", None)
                                    or {}).items():
            state = self.requests.get(request_id)
            if state is not None:
                stores.extend(self.stores.plan_state_stores(state, entries))
        preempted = scheduler_output.preempted_req_ids or ()
        for request_id in preempted:
            self.lookup.release(request_id)
        self.lookup.release_unscheduled()
        self._idle.after_step(scheduler_output.total_num_scheduled_tokens, self._waiting())
        async_loads, final = self.loads.advance()
        if async_loads or final:
            self._idle.reset()
        self.manager.poll()        # finished cascades, and chunks that left a tier
        reused = self.loads.fence_state_blocks(scheduler_output, async_loads)
        return KVHalMetadata(RegionInfo(self.region.share_path, self.layout),
                             self.loads.take_sync_loads(), stores,
                             flush=bool(preempted) or reused, report_sending=report_sending,
                             async_loads=async_loads, recv_final=tuple(final))

    def _waiting(self) -> bool:
        """Something an idle step waits for: a lookup a tier is still deciding, an
        asynchronous load in flight, or work that changes a tier (`has_pending_push_work`)
        (`IdleWait`)."""
        return bool(self.lookup.deciding) or self.loads.in_flight() or self._pending()

    def has_pending_push_work(self) -> bool:
        """Whether vLLM must keep stepping with no request (`KVConnectorBase_V1.
        has_pending_push_work`, consulted by `Scheduler.has_requests`): a host job on the
        workers or a secondary-tier job in flight, or KV events not taken yet. vLLM publishes
        the connector's events only from a step (`Scheduler.update_from_output`), so without
        this, chunks a tier stores after the last request's last step (the fs copies of its
        last chunks) and what a restarted instance finds in its tiers would wait for the next
        request. Such steps compute nothing and wait in `IdleWait` (0.5 ms, doubling to 8 ms),
        so the bound on an event's delay is the job's own time plus at most
        `IDLE_WAIT_MAX_S` and one step (README, "Metrics and KV events inside vLLM")."""
        if self._pending():
            return True
        if self._stop_signalled:
            # vLLM's busy loop ends on this False; at TP > 1 the connector's `shutdown` may
            # never run after it (`lifetime.on_shutdown_signal`), so the tiers drain and close
            # now, while the engine core is sure to be alive.
            self._close_tiers()
        return False

    def _pending(self) -> bool:
        return bool(self.jobs) or self.manager.has_pending_work()

    def _on_stop_signal(self) -> None:
        """SIGTERM/SIGINT reached the engine core (a signal handler: only sets a flag)."""
        self._stop_signalled = True

    def _close_tiers(self) -> None:
        if not self._tiers_closed:
            self._tiers_closed = True
            self.manager.close()

    def update_connector_output(self, worker_meta: KVHalWorkerMetadata | None,
                                finished_recving: set[str] | None = None) -> None:
        """Complete every job that all TP ranks have finished, then settle the asynchronous
        loads vLLM is about to see in `finished_recving` (vLLM calls this before it reads
        them)."""
        self.lookup.steps.finished()
        if worker_meta is not None:
            for job in self.jobs.finish(worker_meta):
                self._complete(job)
        for request_id in finished_recving or ():
            self.loads.settle(request_id)

    def _complete(self, job: Job) -> None:
        """Commit a job every rank finished: its first `num_ok` chunks in the manager and the
        counters; a load that fell short caps its request's later hits."""
        kind = "store" if job.is_store else "load"
        (self.manager.complete_store if job.is_store else self.manager.complete_load)(
            job.job_id, job.num_ok)
        self.counters.add(f"{kind}_chunks", job.group, job.num_ok)
        self.counters.add(f"{kind}_failed_chunks", job.group, job.num_chunks - job.num_ok)
        state = self.requests.get(job.request_id)
        if state is not None:
            state.store_jobs.discard(job.job_id)
            if not job.is_store and job.num_ok < job.num_chunks:
                state.cap_hits(int(job.chunks[job.num_ok]))
        if not job.is_store and job.num_ok < job.num_chunks:
            self.loads.load_failed(job)

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """Release the request's pins; store what is still due; delay vLLM's free while a store
        still reads its blocks.

        vLLM's blocks of the request still hold its KV here and stay allocated until the
        workers report its stores finished (delay_free), so the chunks still due (they found
        no free host slot in the request's last steps) get one more try: those placed are
        stored in the next step, the rest are counted as skipped (`StorePlanner.skip`).

        Returns:
            (delay_free, kv_transfer_params): the params carry `{"kvhal": {"hit_tokens":
            {tier: tokens}, "counters": stats(), "timeline": timeline(...)}}` for the
            request's output (tier "host" or a secondary tier's metrics label, e.g. "fs",
            "fs-2"; counters are this connector's totals so far).
        """
        request_id = request.request_id
        self.lookup.forget(request_id)   # (its lookup pins: those slots may take what is due)
        state = self.requests.pop(request_id)
        if state is not None:
            self.stores.finish_request(state, request.num_computed_tokens)
        self.manager.close_request(request_id)
        self.loads.stop(request_id)
        if state is None:
            return False, None
        params = {"kvhal": {"hit_tokens": dict(state.hit_tokens), "counters": self.stats(),
                            "timeline": timeline(state.times, request)}}
        if state.store_jobs:
            self.stores.delay_free(request_id)
            return True, params
        return False, params

    # -- events and figures ------------------------------------------------------------------
    def take_events(self) -> list:
        """vLLM KV events for the engine's events since the last call (none unless vLLM
        publishes KV events; the engine's are drained either way)."""
        engine_events = self.manager.take_events()
        return [] if self.chunk_events is None else self.chunk_events.translate(engine_events)

    def hit_sources(self, request: Any) -> dict[str, int]:
        """The last `update_state_after_alloc`'s external hit tokens of `request` by vLLM
        `CacheHitSource` value ("host", "disk", "p2p"); they sum to its `num_external_tokens`."""
        state = self.requests.get(request.request_id)
        return {} if state is None else dict(state.hit_sources)

    def take_stats(self) -> dict[str, Any]:
        """The engine's metrics since the last call (`EngineMetrics.take_delta`)."""
        return self.manager.metrics.take_delta()

    def stats(self) -> dict[str, Any]:
        """Counters of this connector plus the manager's and every tier's, and per KV cache
        group (`SideCounters.stats`)."""
        return self.counters.stats(self.manager, self.deployment, self.layout)

    def close(self) -> None:
        """Drain and close the tiers (unless a stop signal closed them already), then
        release the host region."""
        self._close_tiers()
        self.region.close()
