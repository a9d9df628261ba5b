"""The connector's scheduler side: maps vLLM requests to chunk keys and drives the manager.

Runs in vLLM's engine-core process. It never does I/O: it answers vLLM's "how many tokens can
you load" from `Manager.lookup`, reserves host slots for stores and loads, and ships the jobs
to the workers in `KVHalMetadata`. Workers answer in `KVHalWorkerMetadata`; a job completes in
the manager once every TP rank has finished it.

Loads are synchronous in vLLM's sense (`is_async=False`): they run in the same step as the
forward pass that needs them, before it. A load that fails is reported by the worker through
`get_block_ids_with_load_errors`, and vLLM recomputes those blocks.
"""
from __future__ import annotations

import atexit
import glob
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvhal.backends.cpu import CpuBackend
from kvhal.config import EngineConfig
from kvhal.engine import build_manager, chunks_to_store, leading_hits
from kvhal.host import HostRegion, host_geometry
from kvhal.keys import chunk_keys
from kvhal.tiers.base import Lookup

from .events import ChunkEvents
from .geometry import Deployment
from .metadata import KVHalMetadata, KVHalWorkerMetadata, RegionInfo, TransferJob

logger = logging.getLogger(__name__)

#: Shared host regions are `/dev/shm/kvhal-<pid of the scheduler process>-<engine id>`.
SHM_PREFIX = "/dev/shm/kvhal-"

#: Key of the per-request cap in `SamplingParams.extra_args["kv_transfer_params"]`.
MAX_OFFLOAD_TOKENS = "max_offload_tokens"


@dataclass(slots=True)
class _Request:
    """What the scheduler side tracks per live request."""

    request: Any
    max_offload_tokens: int | None
    num_stored_chunks: int = 0
    store_jobs: set[int] = field(default_factory=set)
    # First chunk of the hit found by the last get_num_new_matched_tokens.
    load_start: int = 0
    hit_tokens: dict[str, int] = field(default_factory=dict)    # tier label → tokens
    # The last update_state_after_alloc's hit tokens by vLLM cache-hit source.
    hit_sources: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Job:
    req_id: str
    is_store: bool
    num_chunks: int
    ranks_done: int = 0
    num_ok: int | None = None


class SchedulerSide:
    """Scheduler-side state of one `KVHalConnector` (see the module docstring).

    Args:
        deployment: Geometry and namespace (`geometry.deployment`).
        config: The validated `kv_connector_extra_config`.
        engine_id: vLLM's `kv_transfer_config.engine_id` (names the shared host region).
        kv_events: Whether vLLM publishes KV events (`kv_events_config.enable_kv_cache_events`);
            chunks are described for them only then.

    Attributes:
        kv_cache_manager: vLLM's `KVCacheManager` (a request's block ids), set by the connector
            when vLLM binds it.

    Raises:
        kvhal.config.ConfigError: a secondary tier cannot be built.
        kvhal.host.HostRegionError: the shared host region cannot be created.
    """

    def __init__(self, deployment: Deployment, config: EngineConfig, engine_id: str,
                 kv_events: bool = False):
        self.deployment = deployment
        self.config = config
        geometry = host_geometry(deployment.chunk_nbytes, config.cpu_bytes_to_use)
        remove_stale_regions()
        shm_path = f"{SHM_PREFIX}{os.getpid()}-{engine_id}"
        self.region = HostRegion.create_shared(CpuBackend(), geometry, shm_path)
        # A process that exits without vLLM's shutdown must not leave the region in /dev/shm.
        atexit.register(_unlink, shm_path)
        self.region_info = RegionInfo(shm_path, geometry.slot_bytes, geometry.chunk_nbytes,
                                      geometry.capacity)
        self.manager = build_manager(config, geometry, self.region.view, deployment.namespace)
        self.manager.metrics.keep_samples = True       # shipped each step (`stats.py`)
        self.kv_cache_manager: Any = None
        # tier label → vLLM CacheHitSource value of the tokens it serves
        self._hit_source = {"host": "host", **{label: tier.hit_source for label, tier in
                                               zip(self.manager.tier_labels,
                                                   self.manager.tiers)}}
        self.chunk_events = (ChunkEvents(deployment.block_size, deployment.blocks_per_chunk,
                                         geometry.capacity) if kv_events else None)
        self._requests: dict[str, _Request] = {}
        self._jobs: dict[int, _Job] = {}
        self._loads: list[TransferJob] = []
        self._report_sending: list[str] = []
        self.counters = {"load_chunks": 0, "load_failed_chunks": 0, "store_chunks": 0,
                         "store_failed_chunks": 0}

    # -- keys --------------------------------------------------------------------------------
    def _keys(self, request: Any) -> list:
        return chunk_keys(request.block_hashes, self.deployment.blocks_per_chunk,
                          self.deployment.namespace)

    def _state(self, request: Any) -> _Request:
        state = self._requests.get(request.request_id)
        if state is None:
            params = request.kv_transfer_params or {}
            cap = params.get(MAX_OFFLOAD_TOKENS, self.config.max_offload_tokens)
            if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 0):
                # One request's bad parameter must not take the engine down: store nothing.
                logger.warning("request %s: kv_transfer_params.%s must be an integer ≥ 0, got "
                               "%r; nothing of it is offloaded", request.request_id,
                               MAX_OFFLOAD_TOKENS, cap)
                cap = 0
            state = self._requests[request.request_id] = _Request(request, cap)
        return state

    # -- vLLM scheduler hooks ----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Tokens beyond `num_computed_tokens` loadable from kvhal now (whole chunks only, and
        never the prompt's last token, which vLLM must compute); None asks vLLM to come back
        next step because a chunk is being promoted from a secondary tier.

        With blocks_per_chunk > 1, a local prefix hit that ends inside a chunk gets no external
        hit (loads start at chunk boundaries); vLLM-CPU's 128-token blocks make 1 the default.
        """
        state = self._state(request)
        tpc = self.deployment.tokens_per_chunk
        start = -(-num_computed_tokens // tpc)
        end = (request.num_tokens - 1) // tpc
        if start * tpc != num_computed_tokens or start >= end:
            return 0, False
        keys = self._keys(request)[start:end]
        answers = self.manager.lookup(keys, request_id=request.request_id)
        if self.chunk_events is not None:        # a promotion: describe it while we can
            for i, (key, answer) in enumerate(zip(keys, answers)):
                if answer is Lookup.RETRY:
                    self.chunk_events.record(key, request, start + i)
        hits = leading_hits(answers)
        if hits is None:
            return None, False
        state.load_start = start
        return hits * tpc, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int
                                 ) -> None:
        """Reserve the hit chunks for reading and queue their load into the request's new
        blocks (vLLM has allocated them)."""
        state = self._state(request)
        state.hit_sources = {}
        if num_external_tokens == 0:
            self.manager.release(request.request_id)
            return
        tpc, bpc = self.deployment.tokens_per_chunk, self.deployment.blocks_per_chunk
        n = num_external_tokens // tpc
        keys = self._keys(request)[state.load_start:state.load_start + n]
        plan = self.manager.prepare_load(keys, request_id=request.request_id)
        placed = 0 if plan is None else len(plan.keys)
        slots = np.full(n, -1, dtype=np.int64)  # -1: gone since lookup → the worker fails it
        if plan is not None:
            slots[:placed] = plan.slots
            self._jobs[plan.job_id] = _Job(request.request_id, False, placed)
        block_ids = np.asarray(blocks.get_block_ids()[0], dtype=np.int64)
        first = state.load_start * bpc
        chunk_blocks = block_ids[first:first + n * bpc].reshape(n, bpc)
        job_id = plan.job_id if plan is not None else -1
        self._loads.append(TransferJob(job_id, request.request_id, slots, chunk_blocks))
        # chunks gone since the lookup fail to load; vLLM still counts them as hits, from host
        sources = (*(plan.sources if plan is not None else ()), *("host",) * (n - placed))
        for label in sources:
            state.hit_tokens[label] = state.hit_tokens.get(label, 0) + tpc
            source = self._hit_source[label]
            state.hit_sources[source] = state.hit_sources.get(source, 0) + tpc
        state.num_stored_chunks = max(state.num_stored_chunks, state.load_start + placed)

    def build_connector_meta(self, scheduler_output: Any) -> KVHalMetadata:
        """This step's loads (queued by `update_state_after_alloc`) and stores (full chunks
        this step completes), plus preemption flush and delayed-free reports."""
        stores = []
        scheduled = scheduler_output.num_scheduled_tokens
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, num_scheduled in scheduled.items():
            state = self._requests.get(req_id)
            if state is not None:
                job = self._plan_store(state, computed[req_id] + num_scheduled)
                if job is not None:
                    stores.append(job)
        preempted = scheduler_output.preempted_req_ids or ()
        for req_id in preempted:
            self.manager.release(req_id)
        self.manager.poll()        # finished cascades, and chunks that left a tier
        meta = KVHalMetadata(self.region_info, self._loads, stores, flush=bool(preempted),
                             report_sending=tuple(self._report_sending))
        self._loads, self._report_sending = [], []
        return meta

    def _plan_store(self, state: _Request, num_computed_tokens: int) -> TransferJob | None:
        request, tpc = state.request, self.deployment.tokens_per_chunk
        if self.config.offload_prompt_only:
            num_computed_tokens = min(num_computed_tokens, request.num_prompt_tokens)
        due = chunks_to_store(num_computed_tokens, state.num_stored_chunks, tpc,
                              state.max_offload_tokens)
        if not due:
            return None
        keys = self._keys(request)
        due = range(due.start, min(due.stop, len(keys)))
        state.num_stored_chunks = due.stop
        plan = self.manager.prepare_store([keys[i] for i in due])
        if plan is None:
            return None
        bpc = self.deployment.blocks_per_chunk
        block_ids = np.asarray(self.kv_cache_manager.get_block_ids(request.request_id)[0],
                               dtype=np.int64)
        chunks = plan.indices + due.start
        if self.chunk_events is not None:
            for key, chunk in zip(plan.keys, chunks.tolist()):
                self.chunk_events.record(key, request, chunk)
        blocks = block_ids[(chunks[:, None] * bpc + np.arange(bpc)).ravel()].reshape(-1, bpc)
        self._jobs[plan.job_id] = _Job(request.request_id, True, len(plan.keys))
        state.store_jobs.add(plan.job_id)
        return TransferJob(plan.job_id, request.request_id, plan.slots, blocks)

    def update_connector_output(self, worker_meta: KVHalWorkerMetadata | None) -> None:
        """Complete every job that all TP ranks have finished."""
        if worker_meta is None:
            return
        tp = self.deployment.tp_size
        for job_id, ranks in worker_meta.ranks_done.items():
            job = self._jobs[job_id]
            job.ranks_done += ranks
            ok = worker_meta.num_ok[job_id]
            job.num_ok = ok if job.num_ok is None else min(job.num_ok, ok)
            if job.ranks_done < tp:
                continue
            del self._jobs[job_id]
            self._finish_job(job_id, job)

    def _finish_job(self, job_id: int, job: _Job) -> None:
        state = self._requests.get(job.req_id)
        kind = "store" if job.is_store else "load"
        (self.manager.complete_store if job.is_store else self.manager.complete_load)(
            job_id, job.num_ok)
        self.counters[f"{kind}_chunks"] += job.num_ok
        self.counters[f"{kind}_failed_chunks"] += job.num_chunks - job.num_ok
        if state is not None:
            state.store_jobs.discard(job_id)

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """Release the request's pins; delay vLLM's free while a store still reads its blocks.

        Returns:
            (delay_free, kv_transfer_params): the params carry `{"kvhal": {"hit_tokens":
            {tier: tokens}, "counters": stats()}}` for the request's output (tier "host" or a
            secondary tier's metrics label, e.g. "fs", "fs-2"; counters are this connector's totals so far).
        """
        self.manager.release(request.request_id)
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return False, None
        params = {"kvhal": {"hit_tokens": dict(state.hit_tokens), "counters": self.stats()}}
        if state.store_jobs:
            self._report_sending.append(request.request_id)
            return True, params
        return False, params

    def take_events(self) -> list:
        """vLLM KV events for the engine's events since the last call (none unless vLLM
        publishes KV events; the engine's are drained either way)."""
        engine_events = self.manager.take_events()
        return [] if self.chunk_events is None else self.chunk_events.translate(engine_events)

    def hit_sources(self, request: Any) -> dict[str, int]:
        """The last `update_state_after_alloc`'s external hit tokens of `request` by vLLM
        `CacheHitSource` value ("host", "disk", "p2p"); they sum to its `num_external_tokens`."""
        state = self._requests.get(request.request_id)
        return {} if state is None else dict(state.hit_sources)

    def take_stats(self) -> dict[str, Any]:
        """The engine's metrics since the last call (`EngineMetrics.take_delta`)."""
        return self.manager.metrics.take_delta()

    def stats(self) -> dict[str, Any]:
        """Counters of this connector plus the manager's and every tier's."""
        return {**self.counters, **self.manager.stats(),
                "tiers": {t.name: dict(t.stats()) for t in self.manager.tiers}}

    def close(self) -> None:
        """Drain and close the tiers, then release the host region."""
        self.manager.close()
        self.region.close()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_stale_regions() -> list[str]:
    """Delete host regions whose creating process is gone (killed before its shutdown).

    Returns:
        The paths removed.
    """
    removed = []
    for path in glob.glob(SHM_PREFIX + "*"):
        pid = path[len(SHM_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            _unlink(path)
            removed.append(path)
    return removed
