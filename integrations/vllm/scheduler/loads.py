"""Load planning: the loads of a hit into the blocks vLLM allocated for it, synchronous or
asynchronous, how a late failure cuts a request back, and the fences a state group needs.

State groups (vLLM `MambaSpec`, mamba_cache_mode "align", vLLM 0.32): chunk c of a state group
is the state after the request's first (c + 1) * tokens_per_chunk tokens, one state per layer.
vLLM materialises such a state only where a step ended on a block boundary (the scheduler's
`_mamba_block_aligned_split` ends every prefill step at the prompt's last full block) and hands
each one to the connector with its exact block in
`SchedulerOutput.kv_connector_block_state.boundary_state_offloads` ({request id: [(group,
block id, boundary tokens)]}, drained by `KVCacheManager.take_boundary_state_offloads` in the
step whose forward writes it); kvhal stores exactly those (never a block found by position).
The state block leaves the request's table two steps later (`MambaManager.
remove_skipped_blocks`) and vLLM may hand it to any request then: a step that allocates, loads
into or copies into a block a state store still reads waits for the stores first
(`KVHalMetadata.flush`, before the forward). A hit of chunks [start, end) needs the state of
chunk end - 1 only; vLLM allocates one fresh block for it (index end - 1 of the group's
blocks, the ones before are null) and reads it as the initial state of the next step.
Loads only ever write blocks vLLM allocated for them (`BlockPool.is_block_writable`: sole
owner, not in vLLM's prefix cache), never a block vLLM shares.

Two load paths, chosen per request when vLLM asks:
- one group and every hit chunk in host memory: a synchronous load (`is_async=False`) in the
  same step as the forward pass that needs it, before it. A failed host → device copy (a
  device fault) is reported through `get_block_ids_with_load_errors`. vLLM learns of it only
  after the step, whose forward has already computed the request's later tokens on top of
  the failed blocks (and those of any request that shares them through vLLM's prefix cache):
  the stores of that step that read a failed chunk are never committed (`LoadPlanner.sync_reads`).
- otherwise (a chunk still to be promoted, or several groups: vLLM 0.32 takes no block-level
  errors for several groups, `Deployment.async_loads`): an asynchronous load (`is_async=True`).
  vLLM parks the request in WAITING_FOR_REMOTE_KVS with its blocks allocated while other
  requests run; each step this side ships the chunks that have landed in host memory
  (`KVHalMetadata.async_loads`, host → device while the tier reads the rest) and, after the
  last one or the first failure, tells the workers the load is final
  (`KVHalMetadata.recv_final`); they report it in `finished_recving` once their copies are done.

A chunk that fails after vLLM was told (file vanished, corrupt, tier or device fault) is never
reported to vLLM as a failure (`failed_recving`): under vLLM 0.32's default
`kv_load_failure_policy="fail"` that ends the request with an error. Instead, before vLLM reads
the request's `finished_recving` (`update_connector_output`), this side cuts the request back:
- full-attention / MLA groups only: `request.num_computed_tokens` ends at the first chunk some
  group did not get (what vLLM's "recompute" policy does in
  `_update_requests_with_invalid_blocks`), vLLM's prefill stats follow, and the blocks are
  freed when nothing remains (as `_update_waiting_for_remote_kv` does); vLLM computes the rest.
- with a sliding-window or a state group a shorter hit needs another window or another state,
  which was not loaded: the request goes back to 0 computed tokens with its blocks freed (what vLLM does for
  `failed_recving` under "recompute"), vLLM asks again, and the next hit ends before the first
  chunk a group could not serve (`RequestState.max_hit_chunks`).
Either way the request is answered, correctly, under either policy.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from kvhal.engine import Manager, prefix_hit
from kvhal.layout import Kind
from kvhal.tier import Lookup

from ..geometry import Deployment
from ..metadata import TransferJob
from .counters import SideCounters
from .jobs import InFlightJobs, Job
from .lookup import HitLookup
from .requests import RequestTable, VllmBlocks

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class GroupLoad:
    """One group's part of a load: request chunks `chunks` (int64, ascending) with keys
    `keys` into device blocks `block_ids` (n, blocks_per_chunk); the first `issued` have been
    shipped to the workers, from the tiers `sources` names (`LoadPlan.sources`)."""

    group: int
    chunks: np.ndarray
    keys: list
    block_ids: np.ndarray
    issued: int = 0
    sources: list = field(default_factory=list)


@dataclass(slots=True)
class AsyncLoad:
    """An asynchronous load of request chunks [start, stop) in every group. `failed_at` is
    the first request chunk some group will not get (None: none so far); `final`: no more
    jobs will be shipped (all shipped, a failure, or the request finished: `stopped`)."""

    request: Any
    start: int
    stop: int
    groups: list[GroupLoad]
    failed_at: int | None = None
    final: bool = False
    stopped: bool = False

    def fail(self, chunk: int) -> None:
        self.failed_at = chunk if self.failed_at is None else min(self.failed_at, chunk)


class LoadPlanner:
    """Plans the loads of the hits vLLM allocated blocks for (module docstring).

    Args:
        deployment: Geometry and KV cache groups.
        manager: The engine's manager (load plans, host slots).
        requests: The live requests (states, chunk keys).
        lookup: Pins and hit accounting.
        jobs: Where shipped load jobs are tracked.
        counters: The connector's counters (late failures, state block fences).
        blocks: vLLM's block table.

    Attributes:
        recving: Asynchronous loads by request id, until vLLM reads them in
            `finished_recving` (`settle`).
    """

    def __init__(self, deployment: Deployment, manager: Manager, requests: RequestTable,
                 lookup: HitLookup, jobs: InFlightJobs, counters: SideCounters,
                 blocks: VllmBlocks):
        self._deployment = deployment
        self._manager = manager
        self._requests = requests
        self._lookup = lookup
        self._jobs = jobs
        self._counters = counters
        self._blocks = blocks
        self._state_groups = {g.group_id for g in deployment.groups if g.kind is Kind.MAMBA}
        self._loads: list[TransferJob] = []    # this step's synchronous loads
        self.recving: dict[str, AsyncLoad] = {}

    @property
    def _recompute_all(self) -> bool:
        """A shorter hit needs another window or another state (a sliding-window or a state
        group): a cut-back request recomputes from 0."""
        return any(g.kind not in (Kind.FULL, Kind.MLA) for g in self._deployment.groups)

    # -- planning, when vLLM has allocated the hit's blocks ----------------------------------
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int
                                 ) -> None:
        """Reserve the hit chunks for reading and queue their load into the request's new
        blocks (vLLM has allocated them; a group's null blocks — outside a sliding window, or
        before a state group's last chunk — are not loaded, and neither is a chunk whose block
        vLLM shares with another request, nor anything after it: those fail, `_shared_from`).
        An asynchronous load ships its chunks as they land (`advance`)."""
        state = self._requests.state(request)
        request_id = request.request_id
        self._lookup.asked.discard(request_id)
        state.hit_sources = {}
        if num_external_tokens == 0:
            if request_id not in self.recving:
                self._lookup.release(request_id)
            return
        state.times["alloc"] = time.time()
        dep, null_block_id = self._deployment, self._blocks.null_block_id
        tpc, bpc = dep.tokens_per_chunk, dep.blocks_per_chunk
        start = state.load_start
        stop = start + num_external_tokens // tpc
        group_blocks = blocks.get_block_ids()
        parts, shared = [], None
        for g in dep.groups:
            ids = np.asarray(group_blocks[g.group_id], dtype=np.int64)
            chunk_blocks = ids[start * bpc:stop * bpc].reshape(-1, bpc)
            wanted = np.flatnonzero((chunk_blocks != null_block_id).all(axis=1))
            if g.group_id in self._state_groups:   # the state at the hit's end only
                wanted = wanted[wanted == stop - 1 - start]
                if not len(wanted):    # vLLM gave it no block: the state group serves nothing
                    logger.warning("request %s: no block for the state of group %d chunk %d",
                                   request_id, g.group_id, stop - 1)
                    shared = start if shared is None else min(shared, start)
            cut = self._shared_from(blocks.blocks[g.group_id], start + wanted)
            if cut < len(wanted):
                c = int(start + wanted[cut])
                logger.warning("request %s: vLLM shares the block of group %d chunk %d; kvhal "
                               "loads nothing into it or after it", request_id, g.group_id, c)
                shared = c if shared is None else min(shared, c)
                if state.async_hit:
                    wanted = wanted[:cut]
            all_keys = self._requests.keys(request, g.group_id)
            parts.append(GroupLoad(g.group_id, (start + wanted).astype(np.int64),
                                   [all_keys[start + c] for c in wanted],
                                   chunk_blocks[wanted]))
            if not len(wanted):
                self._manager.release((request_id, g.group_id))
        state.num_stored_chunks = max(state.num_stored_chunks, stop)
        if state.async_hit:
            load = self.recving[request_id] = AsyncLoad(request, start, stop, parts)
            if shared is not None:
                load.fail(shared)
            biggest = max(parts, key=lambda p: len(p.keys))
            self._lookup.credit(state.hit_sources,
                                self._manager.sources(biggest.keys, request_id), source=True)
            return
        (part,) = parts     # synchronous: one group, every chunk in host memory
        safe = len(part.keys) if shared is None else int(np.searchsorted(part.chunks, shared))
        plan = (self._manager.prepare_load(part.keys[:safe], pin_owner=(request_id, part.group))
                if safe else None)
        placed = 0 if plan is None else len(plan.keys)
        slots = np.full(len(part.keys), -1, dtype=np.int64)  # -1: gone since lookup → fails
        job_id = -1
        if plan is not None:
            slots[:placed] = plan.slots
            job_id = plan.job_id
            self._manager.offer(plan.keys, request_id)  # a prefill leg parks what it loaded too
            self._jobs.add(Job(job_id, request_id, False, part.group, part.chunks[:placed]))
        self._loads.append(TransferJob(job_id, request_id, part.group, slots, part.block_ids))
        if placed < len(part.keys):
            state.cap_hits(int(part.chunks[placed]))
        # chunks gone since the lookup fail to load; vLLM still counts them as hits, from host
        labels = (*(plan.sources if plan is not None else ()), *("host",) * (len(part.keys)
                                                                         - placed))
        self._lookup.credit(state.hit_tokens, labels)
        self._lookup.credit(state.hit_sources, labels, source=True)
        state.times["h2d_issue"] = time.time()

    def _shared_from(self, group_blocks: Sequence[Any], chunks: np.ndarray) -> int:
        """Index into `chunks` (request chunk indices, ascending) of the first chunk with a
        block vLLM shares with another request (`KVCacheBlock.ref_cnt` > 1; a load must never
        write it), else `len(chunks)`. `group_blocks` are the request's `KVCacheBlock`s of
        one group (vLLM's `KVCacheBlocks.blocks[group]`)."""
        bpc = self._deployment.blocks_per_chunk
        for i, c in enumerate(chunks.tolist()):
            if any(b.ref_cnt != 1 for b in group_blocks[c * bpc:(c + 1) * bpc]):
                return i
        return len(chunks)

    def take_sync_loads(self) -> list[TransferJob]:
        """This step's synchronous loads, for the workers; the next step starts with none."""
        loads, self._loads = self._loads, []
        return loads

    def sync_reads(self, request_id: str) -> list[tuple[int, int]] | None:
        """Which of this step's synchronous loads the forward of `request_id` reads: its own,
        or one whose blocks it shares through vLLM's prefix cache. Its KV of this step is
        right only if every chunk of them it reads loads, and vLLM learns of a failure only
        after the step (DESIGN §5: a failed chunk fails everything after it).

        Returns:
            [(load job id, leading chunks of that load the request reads)] (empty without
            synchronous loads this step), checked when the load ends
            (`InFlightJobs.read_sync_loads`); None if it reads a chunk that has already failed
            (no host slot: gone since lookup, or after a block vLLM shares), so nothing it
            computes this step may be stored.
        """
        if not self._loads:
            return []
        group_blocks = self._blocks.kv_cache_manager.get_block_ids(request_id)
        reads = []
        for load in self._loads:
            ids = np.asarray(group_blocks[load.group], dtype=np.int64)
            read = np.flatnonzero(np.isin(load.block_ids, ids).any(axis=1))
            if not len(read):
                continue
            need = int(read[-1]) + 1
            held = int(np.argmin(load.slots >= 0)) if (load.slots < 0).any() else len(load.slots)
            if need > held or load.job_id < 0:
                return None
            reads.append((load.job_id, need))
        return reads

    def fence_state_blocks(self, scheduler_output: Any, async_loads: Sequence[TransferJob]
                           ) -> bool:
        """True (and counted in `state_block_fences`) if this step gives a block that a state
        store still reads to new use: vLLM allocated it (a new request's blocks, a running
        one's new blocks), copies into it (`kv_cache_block_copies`), or a load of this step
        (synchronous ones queued, and `async_loads`) writes it. The workers then wait for
        their stores before the forward (`KVHalMetadata.flush`)."""
        reused = self._state_blocks_reused(scheduler_output, [*self._loads, *async_loads])
        self._counters.totals["state_block_fences"] += reused
        return reused

    def _state_blocks_reused(self, scheduler_output: Any, loads: Sequence[TransferJob]
                             ) -> bool:
        reading = self._jobs.state_blocks()
        if not reading:
            return False
        ids = [b for r in scheduler_output.scheduled_new_reqs for g in r.block_ids for b in g]
        for groups in scheduler_output.scheduled_cached_reqs.new_block_ids:
            ids.extend(b for g in groups or () for b in g)
        ids.extend(c.dst_block_id for c in getattr(scheduler_output, "kv_cache_block_copies",
                                                   None) or ())
        for job in loads:
            ids.extend(job.block_ids.ravel().tolist())
        return not reading.isdisjoint(ids)

    # -- asynchronous loads ------------------------------------------------------------------
    def in_flight(self) -> bool:
        """An asynchronous load still has chunks to ship or to hear about."""
        return any(not load.final for load in self.recving.values())

    def advance(self) -> tuple[list[TransferJob], list[str]]:
        """This step's jobs of the asynchronous loads (the chunks that landed since the last
        step), and the request ids whose loads became final this step."""
        async_loads, final = [], []
        for request_id, load in self.recving.items():
            if not load.final:
                async_loads.extend(self._advance(load))
                if load.final:
                    final.append(request_id)
        return async_loads, final

    def _advance(self, load: AsyncLoad) -> list[TransferJob]:
        """Ship the chunks of `load` that landed since the last step; mark it final after
        its last chunk, at the first chunk that will not arrive, or once its request
        finished."""
        request_id = load.request.request_id
        jobs = []
        for part in load.groups:
            if load.stopped or load.failed_at is not None or part.issued == len(part.keys):
                continue
            keys = part.keys[part.issued:]
            answers = self._manager.lookup(keys, pin_owner=(request_id, part.group),
                                           request_id=request_id)
            ready = prefix_hit(answers).num_ready
            plan = (self._manager.prepare_load(keys[:ready],
                                               pin_owner=(request_id, part.group))
                    if ready else None)
            n = 0 if plan is None else len(plan.keys)
            if n:
                jobs.append(TransferJob(plan.job_id, request_id, part.group, plan.slots,
                                        part.block_ids[part.issued:part.issued + n]))
                self._jobs.add(Job(plan.job_id, request_id, False, part.group,
                                   part.chunks[part.issued:part.issued + n]))
                part.issued += n
                part.sources.extend(plan.sources)
                self._manager.offer(plan.keys, request_id)
            if part.issued < len(part.keys) and (n < ready or answers[n] is Lookup.MISS):
                load.fail(int(part.chunks[part.issued]))
        state = self._requests.get(request_id)
        now = time.time()
        if jobs and state is not None:
            state.times.setdefault("first_h2d_issue", now)
            state.times["h2d_issue"] = now
        load.final = (load.stopped or load.failed_at is not None
                      or all(p.issued == len(p.keys) for p in load.groups))
        if load.final:
            self._lookup.release(request_id)
            if state is not None:
                state.times["landed"] = now
        return jobs

    def stop(self, request_id: str) -> None:
        """The request finished: its asynchronous load, if any, ships nothing more (vLLM frees
        the blocks only after finished_recving; the next step tells the workers it is final)."""
        load = self.recving.get(request_id)
        if load is not None:
            load.stopped = True

    def load_failed(self, job: Job) -> None:
        """A finished load job of an asynchronous load got only its first `num_ok` chunks."""
        load = self.recving.get(job.request_id)
        if load is not None:
            load.fail(int(job.chunks[job.num_ok]))

    def settle(self, request_id: str) -> None:
        """A finished asynchronous load (nothing for other requests): credit the chunks that
        arrived and, if some did not, cut the request back so vLLM computes the rest (module
        docstring)."""
        load = self.recving.pop(request_id, None)
        if load is None:
            return
        request, state = load.request, self._requests.get(request_id)
        if state is not None:
            state.times["recv_done"] = time.time()
        if request.is_finished() or state is None:
            return
        biggest = max(load.groups, key=lambda p: len(p.keys))
        if load.failed_at is None:
            self._lookup.credit(state.hit_tokens, biggest.sources)
            return
        tpc = self._deployment.tokens_per_chunk
        arrived = load.failed_at
        recompute_all = self._recompute_all
        self._counters.totals["load_late_failures"] += 1
        state.cap_hits(arrived)
        logger.info("request %s: kvhal chunks %d-%d failed to load after lookup; vLLM "
                    "recomputes from chunk %d", request_id, arrived, load.stop - 1,
                    arrived if not recompute_all else 0)
        if recompute_all:   # another window would be needed: vLLM asks again
            request.num_computed_tokens = 0
            self._blocks.kv_cache_manager.free(request)
            return
        self._lookup.credit(state.hit_tokens, [label for label, c in zip(biggest.sources,
                                                                          biggest.chunks)
                                               if c < arrived])
        request.num_computed_tokens = arrived * tpc
        stats = getattr(request, "prefill_stats", None)
        if stats is not None and stats.num_prompt_tokens:   # vLLM's num_cached_tokens
            stats.set(num_prompt_tokens=stats.num_prompt_tokens,
                      num_local_cached_tokens=stats.num_local_cached_tokens,
                      num_external_cached_tokens=(arrived - load.start) * tpc)
        if request.num_computed_tokens == 0:
            self._blocks.kv_cache_manager.free(request)
