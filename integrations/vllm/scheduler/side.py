"""The connector's scheduler side: maps vLLM requests to chunk keys and drives the manager.

Runs in vLLM's engine-core process. It never does I/O: it answers vLLM's "how many tokens can
you load" from `Manager.lookup`, reserves host slots for stores and loads, and ships the jobs
to the workers in `KVHalMetadata`. Workers answer in `KVHalWorkerMetadata`; a job completes in
the manager once every TP rank has finished it.

Every KV cache group of vLLM (hybrid models: full attention, sliding window, MLA, Mamba /
linear-attention state) has its own chunk keys (`ChunkKey.group`), its own host pool and its
own lookup rule (`kvhal.engine.needed_chunks`): a hit is the longest chunk prefix every group
can serve (a chunk being promoted from a secondary tier counts: it is on its way; one a tier
cannot tell about yet, `Lookup.UNDECIDED`, defers the request's lookup to a later step).

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
  the stores of that step that read a failed chunk are never committed (`_sync_reads`).
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
  chunk a group could not serve (`_Request.max_hit_chunks`).
Either way the request is answered, correctly, under either policy.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from kvhal.backends.cpu import CpuBackend
from kvhal.config import EngineConfig, host_tail_bytes
from kvhal.engine import build_manager, chunks_to_store, needed_chunks, prefix_hit
from kvhal.host import HostRegion, host_layout
from kvhal.keys import chunk_keys
from kvhal.layout import Kind
from kvhal.weights import WeightsError
from kvhal.tier import Lookup

from ..events import ChunkEvents
from ..geometry import Deployment, check_shareable, check_vllm_hash_seed
from ..identity import AdapterIdentities
from ..lifetime import exit_with_parent
from ..metadata import KVHalMetadata, KVHalWorkerMetadata, RegionInfo, TransferJob

logger = logging.getLogger(__name__)

#: Shared host regions are anonymous memory files named `kvhal-<engine id>` (`/memfd:kvhal-...`
#: in `/proc/<pid>/fd`); nothing is created in `/dev/shm`, so no signal can leak one.
REGION_NAME_PREFIX = "kvhal-"

#: Key of the per-request cap in `SamplingParams.extra_args["kv_transfer_params"]`.
MAX_OFFLOAD_TOKENS = "max_offload_tokens"

#: Seconds the first step in a row with nothing to compute waits for a transfer in flight
#: (`_idle_wait`); each further such step waits twice as long, up to `IDLE_WAIT_MAX_S`.
IDLE_WAIT_S = 0.0005
IDLE_WAIT_MAX_S = 0.008

#: Load phases reported by `timeline`, in order.
PHASES = ("lookup", "alloc", "first_h2d_issue", "landed", "h2d_issue", "recv_done")


def timeline(times: dict[str, float], request: Any) -> dict[str, float]:
    """A request's load phases in ms after its arrival (vLLM's `Request.arrival_time`,
    time.time() seconds): lookup (first `get_num_new_matched_tokens`), alloc (vLLM allocated
    its blocks), first_h2d_issue (asynchronous loads: first landed chunks shipped to the
    device), landed (asynchronous loads: every chunk in host memory, or the first failure
    found), h2d_issue (last host → device copy issued), recv_done (asynchronous loads: every
    worker finished). Phases that did not happen are absent."""
    arrival = getattr(request, "arrival_time", None)
    if arrival is None:
        return {}
    return {p: round((times[p] - arrival) * 1e3, 3) for p in PHASES if p in times}


@dataclass(slots=True)
class _Request:
    """What the scheduler side tracks per live request."""

    request: Any
    max_offload_tokens: int | None
    # Identity of the request's LoRA adapter (its keys' scope), None for the base model.
    adapter: bytes | None = None
    # False: the request's KV is neither looked up nor stored (its adapter is unknown).
    reuse: bool = True
    num_stored_chunks: int = 0      # chunks stored or being stored, in order (`_plan_store`)
    store_jobs: set[int] = field(default_factory=set)
    # Chunk range of the hit found by the last get_num_new_matched_tokens.
    load_start: int = 0
    load_end: int = 0
    hit_tokens: dict[str, int] = field(default_factory=dict)    # tier label → tokens
    # The last update_state_after_alloc's hit tokens by vLLM cache-hit source.
    hit_sources: dict[str, int] = field(default_factory=dict)
    # First chunk a group failed to load: later hits end before it.
    max_hit_chunks: int | None = None
    # The last lookup's hit loads asynchronously (vLLM was told is_async=True).
    async_hit: bool = False
    # Wall-clock times (time.time(), s) of this request's load phases (`timeline`).
    times: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class _GroupLoad:
    """One group's part of an asynchronous load: request chunks `chunks` (int64, ascending)
    with keys `keys` into device blocks `block_ids` (n, blocks_per_chunk); the first `issued`
    have been shipped to the workers, from the tiers `sources` names (`LoadPlan.sources`)."""

    group: int
    chunks: np.ndarray
    keys: list
    block_ids: np.ndarray
    issued: int = 0
    sources: list = field(default_factory=list)


@dataclass(slots=True)
class _AsyncLoad:
    """An asynchronous load of request chunks [start, stop) in every group. `failed_at` is
    the first request chunk some group will not get (None: none so far); `final`: no more
    jobs will be shipped (all shipped, a failure, or the request finished: `stopped`)."""

    request: Any
    start: int
    stop: int
    groups: list[_GroupLoad]
    failed_at: int | None = None
    final: bool = False
    stopped: bool = False

    def fail(self, chunk: int) -> None:
        self.failed_at = chunk if self.failed_at is None else min(self.failed_at, chunk)


@dataclass(slots=True)
class _Job:
    req_id: str
    is_store: bool
    group: int
    chunks: np.ndarray          # int64 (n,): the request's chunk index of each job chunk
    ranks_done: int = 0
    num_ok: int | None = None

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)


class SchedulerSide:
    """Scheduler-side state of one `KVHalConnector` (see the module docstring).

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

    Attributes:
        kv_cache_manager: vLLM's `KVCacheManager` (a request's block ids), set by the connector
            when vLLM binds it.

    Raises:
        kvhal.config.ConfigError: a secondary tier cannot be built, or secondary tiers are
            configured while vLLM's block hashes are per-process (`check_shareable`).
        kvhal.host.HostRegionError: the shared host region cannot be created.
    """

    def __init__(self, deployment: Deployment, config: EngineConfig, engine_id: str,
                 namespace: bytes, kv_events: bool = False, data_parallel_index: int = 0):
        self.deployment = deployment
        self.config = config
        self.namespace = namespace
        self.adapters = AdapterIdentities()
        check_shareable(deployment, len(config.secondary_tiers))
        self._seed_checked = False
        self.layout = host_layout(deployment.chunk_nbytes, config.cpu_bytes_to_use,
                                  config.slot_shares(g.kind for g in deployment.groups),
                                  host_tail_bytes(config))
        exit_with_parent()  # a killed API server must not leave this engine holding the region
        self.region = HostRegion.create_shared(CpuBackend(), self.layout,
                                               f"{REGION_NAME_PREFIX}{engine_id}")
        self.region_info = RegionInfo(self.region.share_path, self.layout)
        self.manager = build_manager(config, self.layout, self.region.view, namespace,
                                     data_parallel_index=data_parallel_index)
        self.manager.metrics.keep_samples = True       # shipped each step (`stats.py`)
        self.kv_cache_manager: Any = None
        # tier label → vLLM CacheHitSource value of the tokens it serves
        self._hit_source = {"host": "host", **{label: tier.hit_source for label, tier in
                                               zip(self.manager.tier_labels,
                                                   self.manager.tiers)}}
        self.chunk_events = (ChunkEvents(deployment.block_size, deployment.blocks_per_chunk,
                                         sum(self.layout.capacities)) if kv_events else None)
        # vLLM's null block (the stand-in for blocks a sliding window dropped); set on bind.
        self.null_block_id = 0
        self._prefix_groups = [g for g in deployment.groups
                               if g.kind in (Kind.FULL, Kind.MLA)]
        # groups that need only part of a hit's prefix: a window, or the state at its end
        self._partial_groups = [g for g in deployment.groups
                                if g.kind not in (Kind.FULL, Kind.MLA)]
        self._state_groups = {g.group_id for g in deployment.groups if g.kind is Kind.MAMBA}
        # in-flight state store job → the vLLM block it reads (freed mid-request by vLLM)
        self._state_store_blocks: dict[int, int] = {}
        # synchronous load job → [(store job of its step, leading load chunks it reads)]
        self._sync_readers: dict[int, list[tuple[int, int]]] = {}
        # store job → the synchronous load jobs of its step whose chunks it reads
        self._store_reads: dict[int, list[int]] = {}
        self._tainted_stores: set[int] = set()   # read a chunk whose load failed: num_ok 0
        self._requests: dict[str, _Request] = {}
        self._jobs: dict[int, _Job] = {}
        self._loads: list[TransferJob] = []
        self._stores: list[TransferJob] = []   # planned by request_finished, for the next step
        self._recving: dict[str, _AsyncLoad] = {}
        self._asked: set[str] = set()         # looked up this step, not (yet) allocated
        self._deciding: set[str] = set()      # last lookup undecided: vLLM asks again
        self._idle_steps = 0                  # steps in a row `_idle_wait` waited in
        self._report_sending: list[str] = []
        #: store_skipped_chunks: due for storing, never placed (no free host slot before the
        #: request ended, `_skip`).
        self.counters = {"load_chunks": 0, "load_failed_chunks": 0, "store_chunks": 0,
                         "store_failed_chunks": 0, "store_skipped_chunks": 0}
        n = len(deployment.groups)
        self.group_counters = {k: [0] * n for k in self.counters}
        #: Asynchronous loads cut back after a chunk failed (module docstring).
        self.counters["load_late_failures"] = 0
        #: Steps whose forward waited for state stores reading a block vLLM gave to new use.
        self.counters["state_block_fences"] = 0

    # -- keys --------------------------------------------------------------------------------
    def _keys(self, request: Any, group: int = 0) -> list:
        state = self._requests.get(request.request_id)
        return chunk_keys(request.block_hashes, self.deployment.blocks_per_chunk,
                          self.namespace, group, None if state is None else state.adapter)

    def _release(self, req_id: str) -> None:
        for g in self.deployment.groups:
            self.manager.release((req_id, g.group_id))

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
            adapter, reuse = self._adapter(request)
            state = self._requests[request.request_id] = _Request(
                request, cap if reuse else 0, adapter, reuse)
            if params:   # orchestration for the tiers (p2p: P/D legs), once per request
                self.manager.open_request(request.request_id, params)
        return state

    def _adapter(self, request: Any) -> tuple[bytes | None, bool]:
        """(identity of the request's LoRA adapter or None, whether its KV may be reused and
        stored): an adapter kvhal cannot fingerprint (`AdapterIdentities.of`) gets neither."""
        lora = getattr(request, "lora_request", None)
        try:
            return self.adapters.of(lora), True
        except WeightsError as exc:
            logger.warning("request %s: LoRA adapter %r cannot be fingerprinted (%s); its KV "
                           "is neither reused nor stored", request.request_id,
                           getattr(lora, "lora_name", "?"), exc)
            return None, False

    # -- vLLM scheduler hooks ----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Tokens beyond `num_computed_tokens` kvhal can load (whole chunks only, and never the
        prompt's last token, which vLLM must compute), and whether the load is asynchronous:
        True with several groups (`Deployment.async_loads`) or when a chunk of the hit is
        still on its way into host memory (a promotion from a secondary tier, a store in
        flight). (None, False) while a secondary tier cannot tell yet whether it holds a chunk
        the hit needs (`Lookup.UNDECIDED`, e.g. a p2p tier asking the peer a request names):
        vLLM skips the request this step and asks again on a later one (vLLM's connector API:
        "needs more time to determine the number of matched tokens"), so a chunk the tier
        then finds absent is never claimed and failed late.

        With blocks_per_chunk > 1, a local prefix hit that ends inside a chunk gets no external
        hit (loads start at chunk boundaries); vLLM-CPU's 128-token blocks make 1 the default.

        (0, False) without looking anything up (nothing is promoted or pinned) for a request
        vLLM computes in full whatever is cached (`Request.skip_reading_prefix_cache`, set for
        prompt logprobs); its chunks are still stored. Likewise, storing nothing either, for a
        request whose LoRA adapter kvhal cannot fingerprint (`_adapter`).
        """
        if not self._seed_checked:  # vLLM seeds its hashes after building the connector
            check_vllm_hash_seed(self.deployment)
            self._seed_checked = True
        state = self._state(request)
        if request.skip_reading_prefix_cache or not state.reuse:
            return 0, False
        state.times.setdefault("lookup", time.time())
        tpc = self.deployment.tokens_per_chunk
        start = -(-num_computed_tokens // tpc)
        end = (request.num_tokens - 1) // tpc
        if state.max_hit_chunks is not None:
            end = min(end, state.max_hit_chunks)
        if start * tpc != num_computed_tokens or start >= end:
            return 0, False
        self._asked.add(request.request_id)
        found = self._hit_end(request, state, start, end)
        if found is None:
            self._deciding.add(request.request_id)
            return None, False
        self._deciding.discard(request.request_id)
        hit_end, pending = found
        state.load_start, state.load_end = start, hit_end
        if hit_end == start:
            return 0, False
        state.async_hit = pending or self.deployment.async_loads
        return (hit_end - start) * tpc, state.async_hit

    def _hit_end(self, request: Any, state: _Request, start: int, end: int
                 ) -> tuple[int, bool] | None:
        """The end chunk of the longest hit in [start, end) every group can serve (pins its
        resident chunks), and whether a chunk of it is still on its way into host memory; None
        if a chunk that hit needs is UNDECIDED (every group was asked first, so each tier
        that cannot tell yet is finding out meanwhile)."""
        rid, dep = request.request_id, self.deployment
        limit, pending, undecided = end, False, False
        for g in self._prefix_groups:   # whole prefix: the chunks before the first MISS
            keys = self._keys(request, g.group_id)[start:end]
            answers = self.manager.lookup(keys, request_id=(rid, g.group_id), context=rid)
            self._describe(request, start, keys, answers)
            hit = prefix_hit(answers)
            pending = pending or hit.pending
            undecided = undecided or hit.undecided
            limit = min(limit, start + hit.num_chunks)
        if not self._partial_groups:
            return None if undecided else (limit, pending)
        keys = {g.group_id: self._keys(request, g.group_id) for g in self._partial_groups}
        probed: dict[tuple[int, int], Lookup] = {}

        def answer(group: int, chunk: int) -> Lookup:
            if (group, chunk) not in probed:  # each chunk once per call (promotions start once)
                probed[group, chunk] = self.manager.lookup([keys[group][chunk]],
                                                           context=rid)[0]
                if probed[group, chunk] is Lookup.RETRY:
                    self._describe(request, chunk, [keys[group][chunk]], [Lookup.RETRY])
            return probed[group, chunk]

        hit_end = start
        for n in range(limit, start, -1):  # window and state groups: from the longest down
            need = [(g.group_id, c) for g in self._partial_groups for c in reversed(
                needed_chunks(g.kind, start, n, dep.tokens_per_chunk, dep.block_size,
                              g.sliding_window))]
            if all(answer(group, chunk) is not Lookup.MISS for group, chunk in need):
                hit_end = n
                pending = pending or any(probed[k] is Lookup.RETRY for k in need)
                undecided = undecided or any(probed[k] is Lookup.UNDECIDED for k in need)
                break
        if undecided:
            return None
        for g in self._partial_groups:
            rng = needed_chunks(g.kind, start, hit_end, dep.tokens_per_chunk, dep.block_size,
                                g.sliding_window)
            self.manager.lookup([keys[g.group_id][c] for c in rng],
                                request_id=(rid, g.group_id), context=rid)
        return hit_end, pending

    def _describe(self, request: Any, start: int, keys: list, answers: list) -> None:
        """Describe the chunks being promoted (from chunk `start` on) for their KV events."""
        if self.chunk_events is not None:
            for i, (key, answer) in enumerate(zip(keys, answers)):
                if answer is Lookup.RETRY:
                    self.chunk_events.record(key, request, start + i)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int
                                 ) -> None:
        """Reserve the hit chunks for reading and queue their load into the request's new
        blocks (vLLM has allocated them; a group's null blocks — outside a sliding window, or
        before a state group's last chunk — are not loaded, and neither is a chunk whose block
        vLLM shares with another request, nor anything after it: those fail, `_shared_from`).
        An asynchronous load ships its chunks as they land (`build_connector_meta`)."""
        state = self._state(request)
        rid = request.request_id
        self._asked.discard(rid)
        state.hit_sources = {}
        if num_external_tokens == 0:
            if rid not in self._recving:
                self._release(rid)
            return
        state.times["alloc"] = time.time()
        dep = self.deployment
        tpc, bpc = dep.tokens_per_chunk, dep.blocks_per_chunk
        start = state.load_start
        stop = start + num_external_tokens // tpc
        group_blocks = blocks.get_block_ids()
        parts, shared = [], None
        for g in dep.groups:
            ids = np.asarray(group_blocks[g.group_id], dtype=np.int64)
            chunk_blocks = ids[start * bpc:stop * bpc].reshape(-1, bpc)
            wanted = np.flatnonzero((chunk_blocks != self.null_block_id).all(axis=1))
            if g.group_id in self._state_groups:   # the state at the hit's end only
                wanted = wanted[wanted == stop - 1 - start]
                if not len(wanted):    # vLLM gave it no block: the state group serves nothing
                    logger.warning("request %s: no block for the state of group %d chunk %d",
                                   rid, g.group_id, stop - 1)
                    shared = start if shared is None else min(shared, start)
            cut = self._shared_from(blocks.blocks[g.group_id], start + wanted)
            if cut < len(wanted):
                c = int(start + wanted[cut])
                logger.warning("request %s: vLLM shares the block of group %d chunk %d; kvhal "
                               "loads nothing into it or after it", rid, g.group_id, c)
                shared = c if shared is None else min(shared, c)
                if state.async_hit:
                    wanted = wanted[:cut]
            all_keys = self._keys(request, g.group_id)
            parts.append(_GroupLoad(g.group_id, (start + wanted).astype(np.int64),
                                    [all_keys[start + c] for c in wanted],
                                    chunk_blocks[wanted]))
            if not len(wanted):
                self.manager.release((rid, g.group_id))
        state.num_stored_chunks = max(state.num_stored_chunks, stop)
        if state.async_hit:
            load = self._recving[rid] = _AsyncLoad(request, start, stop, parts)
            if shared is not None:
                load.fail(shared)
            biggest = max(parts, key=lambda p: len(p.keys))
            self._credit(state.hit_sources, self.manager.sources(biggest.keys, rid),
                         source=True)
            return
        (part,) = parts     # synchronous: one group, every chunk in host memory
        safe = len(part.keys) if shared is None else int(np.searchsorted(part.chunks, shared))
        plan = (self.manager.prepare_load(part.keys[:safe], request_id=(rid, part.group))
                if safe else None)
        placed = 0 if plan is None else len(plan.keys)
        slots = np.full(len(part.keys), -1, dtype=np.int64)  # -1: gone since lookup → fails
        job_id = -1
        if plan is not None:
            slots[:placed] = plan.slots
            job_id = plan.job_id
            self.manager.offer(plan.keys, rid)     # a prefill leg parks what it loaded too
            self._jobs[job_id] = _Job(rid, False, part.group, part.chunks[:placed])
        self._loads.append(TransferJob(job_id, rid, part.group, slots, part.block_ids))
        if placed < len(part.keys):
            self._cap(state, int(part.chunks[placed]))
        # chunks gone since the lookup fail to load; vLLM still counts them as hits, from host
        labels = (*(plan.sources if plan is not None else ()), *("host",) * (len(part.keys)
                                                                         - placed))
        self._credit(state.hit_tokens, labels)
        self._credit(state.hit_sources, labels, source=True)
        state.times["h2d_issue"] = time.time()

    def _credit(self, into: dict[str, int], labels: Sequence[str], source: bool = False
                ) -> None:
        """Add a chunk's tokens to `into` per tier label in `labels` (by vLLM cache-hit
        source if `source`)."""
        tpc = self.deployment.tokens_per_chunk
        for label in labels:
            name = self._hit_source[label] if source else label
            into[name] = into.get(name, 0) + tpc

    def _shared_from(self, group_blocks: Sequence[Any], chunks: np.ndarray) -> int:
        """Index into `chunks` (request chunk indices, ascending) of the first chunk with a
        block vLLM shares with another request (`KVCacheBlock.ref_cnt` > 1; a load must never
        write it), else `len(chunks)`. `group_blocks` are the request's `KVCacheBlock`s of
        one group (vLLM's `KVCacheBlocks.blocks[group]`)."""
        bpc = self.deployment.blocks_per_chunk
        for i, c in enumerate(chunks.tolist()):
            if any(b.ref_cnt != 1 for b in group_blocks[c * bpc:(c + 1) * bpc]):
                return i
        return len(chunks)

    @staticmethod
    def _cap(state: _Request, chunk: int) -> None:
        state.max_hit_chunks = (chunk if state.max_hit_chunks is None
                                else min(state.max_hit_chunks, chunk))

    # -- asynchronous loads ------------------------------------------------------------------
    def _advance(self, load: _AsyncLoad) -> list[TransferJob]:
        """Ship the chunks of `load` that landed since the last step; mark it final after
        its last chunk, at the first chunk that will not arrive, or once its request
        finished."""
        rid = load.request.request_id
        jobs = []
        for part in load.groups:
            if load.stopped or load.failed_at is not None or part.issued == len(part.keys):
                continue
            keys = part.keys[part.issued:]
            answers = self.manager.lookup(keys, request_id=(rid, part.group), context=rid)
            ready = prefix_hit(answers).num_ready
            plan = (self.manager.prepare_load(keys[:ready], request_id=(rid, part.group))
                    if ready else None)
            n = 0 if plan is None else len(plan.keys)
            if n:
                jobs.append(TransferJob(plan.job_id, rid, part.group, plan.slots,
                                        part.block_ids[part.issued:part.issued + n]))
                self._jobs[plan.job_id] = _Job(rid, False, part.group,
                                               part.chunks[part.issued:part.issued + n])
                part.issued += n
                part.sources.extend(plan.sources)
                self.manager.offer(plan.keys, rid)
            if part.issued < len(part.keys) and (n < ready or answers[n] is Lookup.MISS):
                load.fail(int(part.chunks[part.issued]))
        state = self._requests.get(rid)
        now = time.time()
        if jobs and state is not None:
            state.times.setdefault("first_h2d_issue", now)
            state.times["h2d_issue"] = now
        load.final = (load.stopped or load.failed_at is not None
                      or all(p.issued == len(p.keys) for p in load.groups))
        if load.final:
            self._release(rid)
            if state is not None:
                state.times["landed"] = now
        return jobs

    def _idle_wait(self, scheduler_output: Any) -> None:
        """A step with nothing to compute whose only work is a transfer in flight, or a
        lookup a tier is still deciding (`get_num_new_matched_tokens` answered None): wait a
        moment instead of spinning (vLLM's engine loop calls `schedule` again at once, and
        each empty step also runs the workers): `IDLE_WAIT_S`, doubled for each such step in a
        row up to `IDLE_WAIT_MAX_S`, and back to `IDLE_WAIT_S` once a step computes or an
        asynchronous load ships chunks. A short load (a promotion from a local tier) is seen
        within a fraction of a millisecond; a decode leg waiting seconds for its prefiller no
        longer runs ~2,700 lookups/s (a 0.5 ms wait). Each step still reaches the workers,
        whose queue readers would spin between such steps: `spin.bound_reader_spin` keeps
        them asleep. Adds at most `IDLE_WAIT_MAX_S` to noticing a chunk or a new request
        during a long wait."""
        if scheduler_output.total_num_scheduled_tokens == 0 and (self._deciding or any(
                not load.final for load in self._recving.values())):
            time.sleep(min(IDLE_WAIT_S * 2 ** self._idle_steps, IDLE_WAIT_MAX_S))
            self._idle_steps = min(self._idle_steps + 1, 16)
        else:
            self._idle_steps = 0

    def _settle(self, rid: str) -> None:
        """A finished asynchronous load: credit the chunks that arrived and, if some did not,
        cut the request back so vLLM computes the rest (module docstring)."""
        load = self._recving.pop(rid)
        request, state = load.request, self._requests.get(rid)
        if state is not None:
            state.times["recv_done"] = time.time()
        if request.is_finished() or state is None:
            return
        biggest = max(load.groups, key=lambda p: len(p.keys))
        if load.failed_at is None:
            self._credit(state.hit_tokens, biggest.sources)
            return
        tpc = self.deployment.tokens_per_chunk
        arrived = load.failed_at
        self.counters["load_late_failures"] += 1
        self._cap(state, arrived)
        logger.info("request %s: kvhal chunks %d-%d failed to load after lookup; vLLM "
                    "recomputes from chunk %d", rid, arrived, load.stop - 1,
                    arrived if not self._partial_groups else 0)
        if self._partial_groups:   # another window would be needed: vLLM asks again
            request.num_computed_tokens = 0
            self.kv_cache_manager.free(request)
            return
        self._credit(state.hit_tokens, [label for label, c in zip(biggest.sources,
                                                                   biggest.chunks) if c < arrived])
        request.num_computed_tokens = arrived * tpc
        stats = getattr(request, "prefill_stats", None)
        if stats is not None and stats.num_prompt_tokens:   # vLLM's num_cached_tokens
            stats.set(num_prompt_tokens=stats.num_prompt_tokens,
                      num_local_cached_tokens=stats.num_local_cached_tokens,
                      num_external_cached_tokens=(arrived - load.start) * tpc)
        if request.num_computed_tokens == 0:
            self.kv_cache_manager.free(request)

    def build_connector_meta(self, scheduler_output: Any) -> KVHalMetadata:
        """This step's loads (synchronous ones queued by `update_state_after_alloc`, chunks of
        asynchronous ones that landed), stores (the full chunks due: this step's, and earlier
        ones that found no free host slot then; those `request_finished` placed), preemption
        flush and delayed-free reports. Requests looked up but not scheduled this step hold
        no pins afterwards."""
        stores, self._stores = self._stores, []
        scheduled = scheduler_output.num_scheduled_tokens
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, num_scheduled in scheduled.items():
            state = self._requests.get(req_id)
            if state is None:
                continue
            reads = self._sync_reads(req_id) if self._loads else []
            if reads is None:   # computed on a block whose load already failed: store nothing
                continue
            jobs, _ = self._plan_store(state, computed[req_id], computed[req_id] + num_scheduled)
            for job in jobs:
                for load_id, need in reads:
                    self._sync_readers.setdefault(load_id, []).append((job.job_id, need))
                    self._store_reads.setdefault(job.job_id, []).append(load_id)
            stores.extend(jobs)
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        for req_id, entries in (getattr(block_state, "boundary_state_offloads", None)
                                or {}).items():
            state = self._requests.get(req_id)
            if state is not None and self._state_groups:
                stores.extend(self._plan_state_stores(state, entries))
        preempted = scheduler_output.preempted_req_ids or ()
        for req_id in preempted:
            self._release(req_id)
        for req_id in self._asked:   # asked about but not scheduled: hold nothing for them
            self._release(req_id)
        self._asked.clear()
        self._idle_wait(scheduler_output)
        async_loads, final = [], []
        for req_id, load in self._recving.items():
            if not load.final:
                async_loads.extend(self._advance(load))
                if load.final:
                    final.append(req_id)
        if async_loads or final:
            self._idle_steps = 0    # chunks are landing: the next idle step waits briefly
        self.manager.poll()        # finished cascades, and chunks that left a tier
        reused = self._state_blocks_reused(scheduler_output, [*self._loads, *async_loads])
        self.counters["state_block_fences"] += reused
        meta = KVHalMetadata(self.region_info, self._loads, stores,
                             flush=bool(preempted) or reused,
                             report_sending=tuple(self._report_sending),
                             async_loads=async_loads, recv_final=tuple(final))
        self._loads, self._report_sending = [], []
        return meta

    def _sync_reads(self, req_id: str) -> list[tuple[int, int]] | None:
        """Which of this step's synchronous loads (`self._loads`) the forward of `req_id`
        reads: its own, or one whose blocks it shares through vLLM's prefix cache. Its KV of
        this step is right only if every chunk of them it reads loads, and vLLM learns of a
        failure only after the step (DESIGN §5: a failed chunk fails everything after it).

        Returns:
            [(load job id, leading chunks of that load the request reads)], checked when
            the load ends (`_finish_job`); None if it reads a chunk that has already failed
            (no host slot: gone since lookup, or after a block vLLM shares), so nothing it
            computes this step may be stored.
        """
        group_blocks = self.kv_cache_manager.get_block_ids(req_id)
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

    def _plan_store(self, state: _Request, num_computed_tokens: int, num_done_tokens: int
                    ) -> tuple[list[TransferJob], dict[int, int]]:
        """Store jobs for the full chunks of `state`'s request that are due: vLLM held
        `num_computed_tokens` of its tokens before the step, `num_done_tokens` after it; and
        per group, the due chunks it could not place (from the first that found no free host
        slot on), {group: chunks}.

        A chunk is due from the step that completes it until it is placed (`prepare_store`
        reserved its host slot) or kvhal holds it already: the stored-chunk cursor
        (`_Request.num_stored_chunks`) moves only past those, and never past the first chunk
        some group could not place (the host tier had no free slot), so that chunk and the
        ones after it are due again in the next step that schedules the request (or in
        `request_finished`), and the chunks kvhal stores of a prefix never have a gap. A chunk
        a sliding window already dropped (a null block) is never stored.

        The cursor never stays ahead of what vLLM holds: where vLLM goes back below it, it
        computes those chunks again and they are due again. That happens after an asynchronous
        load was cut back to the chunk that failed (`_settle`; the chunks before it were
        loaded, so they are in host memory and stay behind the cursor), after vLLM rolled a
        failed synchronous load back to its first invalid block (the step after the failure;
        the stores of the failing step that read a failed chunk were not committed,
        `_sync_reads`), and when a preempted request is admitted again with a shorter hit than
        it had stored. `Manager.prepare_store` skips the due chunks kvhal still holds, those
        being stored included (they are in its index): no chunk is stored twice at once.
        """
        request, dep = state.request, self.deployment
        state.num_stored_chunks = min(state.num_stored_chunks,
                                      num_computed_tokens // dep.tokens_per_chunk)
        if self.config.offload_prompt_only:
            num_done_tokens = min(num_done_tokens, request.num_prompt_tokens)
        bpc = dep.blocks_per_chunk
        due = chunks_to_store(num_done_tokens, state.num_stored_chunks, dep.tokens_per_chunk,
                              state.max_offload_tokens)
        due = range(due.start, min(due.stop, len(request.block_hashes) // bpc))
        if not due:
            return [], {}
        group_blocks = self.kv_cache_manager.get_block_ids(request.request_id)
        jobs, unplaced, cursor = [], {}, due.stop
        for g in dep.groups:
            if g.group_id in self._state_groups:   # stored as vLLM hands states over
                continue
            keys = self._keys(request, g.group_id)
            ids = np.asarray(group_blocks[g.group_id], dtype=np.int64)
            chunks = np.arange(due.start, due.stop, dtype=np.int64)
            blocks = ids[(chunks[:, None] * bpc + np.arange(bpc)).ravel()].reshape(-1, bpc)
            held = (blocks != self.null_block_id).all(axis=1)  # a window may have dropped some
            chunks, blocks = chunks[held], blocks[held]
            due_keys = [keys[c] for c in chunks]
            plan = self.manager.prepare_store(due_keys, context=request.request_id)
            placed = self.manager.num_held(due_keys)
            if placed < len(chunks):               # no free slot for it: still due
                cursor = min(cursor, int(chunks[placed]))
                unplaced[g.group_id] = len(chunks) - placed
            if plan is None:
                continue
            if self.chunk_events is not None:
                for key, chunk in zip(plan.keys, chunks[plan.indices].tolist()):
                    self.chunk_events.record(key, request, chunk)
            self._jobs[plan.job_id] = _Job(request.request_id, True, g.group_id,
                                           chunks[plan.indices])
            state.store_jobs.add(plan.job_id)
            jobs.append(TransferJob(plan.job_id, request.request_id, g.group_id, plan.slots,
                                    blocks[plan.indices]))
        state.num_stored_chunks = cursor
        return jobs, unplaced

    def _skip(self, group: int, num_chunks: int) -> None:
        """Count `num_chunks` chunks of `group` that were due but will never be stored (their
        request ended, or a state's block is gone, before a host slot was free)."""
        self.counters["store_skipped_chunks"] += num_chunks
        self.group_counters["store_skipped_chunks"][group] += num_chunks
        self.manager.skip_store(num_chunks)

    def _plan_state_stores(self, state: _Request, entries: Sequence[tuple[int, int, int]]
                           ) -> list[TransferJob]:
        """Store jobs for the states vLLM handed over this step (`entries`: (group, block id,
        boundary tokens) from `boundary_state_offloads`): a state at a chunk boundary within
        what the request may offload (its prompt with `offload_prompt_only`, its
        `max_offload_tokens`) becomes that chunk of its group; others are skipped. A state
        that finds no free host slot is counted as skipped (`_skip`): its block leaves the
        request's table, so it is never due again."""
        request, dep = state.request, self.deployment
        tpc = dep.tokens_per_chunk
        limit = (request.num_prompt_tokens if self.config.offload_prompt_only
                 else request.num_tokens)
        if state.max_offload_tokens is not None:
            limit = min(limit, state.max_offload_tokens)
        limit = min(limit, len(request.block_hashes) * dep.block_size)
        jobs = []
        for group, block_id, boundary in entries:
            if (group not in self._state_groups or block_id == self.null_block_id
                    or boundary <= 0 or boundary % tpc or boundary > limit):
                continue
            chunk = boundary // tpc - 1
            key = self._keys(request, group)[chunk]
            plan = self.manager.prepare_store([key], context=request.request_id)
            if plan is None:
                if not self.manager.num_held([key]):
                    self._skip(group, 1)
                continue
            if self.chunk_events is not None:
                self.chunk_events.record(key, request, chunk)
            self._jobs[plan.job_id] = _Job(request.request_id, True, group,
                                           np.array([chunk], np.int64))
            self._state_store_blocks[plan.job_id] = block_id
            state.store_jobs.add(plan.job_id)
            jobs.append(TransferJob(plan.job_id, request.request_id, group, plan.slots,
                                    np.array([[block_id]], np.int64)))
        return jobs

    def _state_blocks_reused(self, scheduler_output: Any, loads: Sequence[TransferJob]
                             ) -> bool:
        """True if this step gives a block that a state store still reads to new use: vLLM
        allocated it (a new request's blocks, a running one's new blocks), copies into it
        (`kv_cache_block_copies`), or a load of this step writes it. The workers then wait for
        their stores before the forward (`KVHalMetadata.flush`)."""
        if not self._state_store_blocks:
            return False
        reading = set(self._state_store_blocks.values())
        ids = [b for r in scheduler_output.scheduled_new_reqs for g in r.block_ids for b in g]
        for groups in scheduler_output.scheduled_cached_reqs.new_block_ids:
            ids.extend(b for g in groups or () for b in g)
        ids.extend(c.dst_block_id for c in getattr(scheduler_output, "kv_cache_block_copies",
                                                   None) or ())
        for job in loads:
            ids.extend(job.block_ids.ravel().tolist())
        return not reading.isdisjoint(ids)

    def update_connector_output(self, worker_meta: KVHalWorkerMetadata | None,
                                finished_recving: set[str] | None = None) -> None:
        """Complete every job that all TP ranks have finished, then settle the asynchronous
        loads vLLM is about to see in `finished_recving` (vLLM calls this before it reads
        them)."""
        self._complete_jobs(worker_meta)
        for req_id in finished_recving or ():
            if req_id in self._recving:
                self._settle(req_id)

    def _complete_jobs(self, worker_meta: KVHalWorkerMetadata | None) -> None:
        if worker_meta is None:
            return
        tp = self.deployment.tp_size
        # loads first: a store reading a synchronous load of its step is judged after it
        for job_id, ranks in sorted(worker_meta.ranks_done.items(),
                                    key=lambda item: self._jobs[item[0]].is_store):
            job = self._jobs[job_id]
            job.ranks_done += ranks
            ok = worker_meta.num_ok[job_id]
            job.num_ok = ok if job.num_ok is None else min(job.num_ok, ok)
            if job.ranks_done < tp:
                continue
            del self._jobs[job_id]
            self._finish_job(job_id, job)

    def _finish_job(self, job_id: int, job: _Job) -> None:
        self._state_store_blocks.pop(job_id, None)
        for store_id, need in self._sync_readers.pop(job_id, ()):
            if job.num_ok < need:
                self._tainted_stores.add(store_id)
        reads = self._store_reads.pop(job_id, ())
        if job_id in self._tainted_stores or any(r in self._sync_readers for r in reads):
            self._tainted_stores.discard(job_id)   # (a load not judged yet counts as failed)
            job.num_ok = 0
        state = self._requests.get(job.req_id)
        kind = "store" if job.is_store else "load"
        (self.manager.complete_store if job.is_store else self.manager.complete_load)(
            job_id, job.num_ok)
        self.counters[f"{kind}_chunks"] += job.num_ok
        self.counters[f"{kind}_failed_chunks"] += job.num_chunks - job.num_ok
        self.group_counters[f"{kind}_chunks"][job.group] += job.num_ok
        self.group_counters[f"{kind}_failed_chunks"][job.group] += job.num_chunks - job.num_ok
        if state is not None:
            state.store_jobs.discard(job_id)
            if not job.is_store and job.num_ok < job.num_chunks:
                self._cap(state, int(job.chunks[job.num_ok]))
        load = self._recving.get(job.req_id)
        if load is not None and not job.is_store and job.num_ok < job.num_chunks:
            load.fail(int(job.chunks[job.num_ok]))

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """Release the request's pins; store what is still due; delay vLLM's free while a store
        still reads its blocks.

        vLLM's blocks of the request still hold its KV here and stay allocated until the
        workers report its stores finished (delay_free), so the chunks still due (they found
        no free host slot in the request's last steps) get one more try: those placed are
        stored in the next step, the rest are counted as skipped (`_skip`).

        Returns:
            (delay_free, kv_transfer_params): the params carry `{"kvhal": {"hit_tokens":
            {tier: tokens}, "counters": stats(), "timeline": timeline(...)}}` for the
            request's output (tier "host" or a secondary tier's metrics label, e.g. "fs",
            "fs-2"; counters are this connector's totals so far).
        """
        rid = request.request_id
        self._release(rid)     # (its lookup pins: those slots may take what is due)
        self._asked.discard(rid)
        self._deciding.discard(rid)
        state = self._requests.pop(rid, None)
        if state is not None:
            jobs, unplaced = self._plan_store(state, request.num_computed_tokens,
                                              request.num_computed_tokens)
            self._stores.extend(jobs)
            for group, num_chunks in unplaced.items():
                self._skip(group, num_chunks)
        self.manager.close_request(rid)
        load = self._recving.get(rid)
        if load is not None:
            # vLLM frees the blocks only after finished_recving: ship nothing more; the next
            # build_connector_meta tells the workers the load is final.
            load.stopped = True
        if state is None:
            return False, None
        params = {"kvhal": {"hit_tokens": dict(state.hit_tokens), "counters": self.stats(),
                            "timeline": timeline(state.times, request)}}
        if state.store_jobs:
            self._report_sending.append(rid)
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
        """Counters of this connector plus the manager's and every tier's, and per KV cache
        group (`groups`, in group order): kind, canonical chunk bytes, host slot bytes, slots,
        host bytes (slots × slot bytes, exact), resident chunks, and the load/store counters."""
        index = self.manager.slots.index
        groups = []
        for g, pool in zip(self.deployment.groups, self.layout.pools):
            resident = sum(1 for k in index if k.group == g.group_id)
            groups.append({"group": g.group_id, "kind": g.kind.value,
                           "chunk_bytes": pool.chunk_nbytes, "slot_bytes": pool.slot_bytes,
                           "slots": pool.capacity, "host_bytes": pool.nbytes,
                           "resident": resident,
                           **{k: v[g.group_id] for k, v in self.group_counters.items()}})
        return {**self.counters, **self.manager.stats(), "groups": groups,
                "tiers": {t.name: dict(t.stats()) for t in self.manager.tiers}}

    def close(self) -> None:
        """Drain and close the tiers, then release the host region."""
        self.manager.close()
        self.region.close()
