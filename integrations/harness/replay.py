"""The replay: trace requests through the real manager, worker, HAL and tiers, with real bytes.

Per request, in trace order (one request at a time, as one engine step each):

1. Device hits: the longest prefix of its full chunks cached in the device pool (`DevicePool`,
   vLLM's GPU prefix cache).
2. Tier hits: `Manager.lookup` over the rest; RETRY (a secondary tier promoting a chunk into a
   host slot) is polled until it resolves. Leading HITs are loaded H2D by the `Worker` into
   fresh device blocks; a HIT answered at once is a host hit, one that needed a promotion is a
   hit of the secondary tier that holds it.
3. Every hit chunk (device or loaded) is copied D2H into a staging buffer and verified byte for
   byte against the payload its key generates (`payload`); a mismatch raises
   `PayloadMismatchError` — the run is invalid.
4. "Prefill": the missed chunks' payloads are written into their device blocks (H2D from a
   staging buffer on a compute stream), then stored D2H through `Manager.prepare_store` /
   `Worker.submit_store(after=compute event)` / `complete_store`, which cascades them to every
   secondary tier.
5. The request's device blocks are freed into the device pool's prefix cache.

With `instances` > 1 each instance has its own device pool, host region, manager, worker and
secondary tiers (p2p tiers wired to each other, `instance_configs`); request i runs on
instance i mod instances, and between requests the replay waits until every p2p directory
has applied what the other instances announced, so a chunk another instance holds in host
memory is a p2p hit whatever the feed timing. Hits and traffic are totals over instances.

Chunk = the trace's block (512 tokens for Mooncake) = one device block. The device KV pool is
one device allocation per TP rank cut into per-layer tensors of a `kvhal.layout` device layout
(default: the geometry's, packed-hnd for full attention — vLLM's GPU layout — and mla for
MLA); each rank's worker moves chunks with its rank's `LayoutPlanner`, and the replay's own
compute and verification copies use the same layout plans from a canonical staging buffer.
Partial last blocks are never stored nor hit (their tokens are always recomputed).

TP > 1 (MLA only): vLLM holds the same latent page on every rank, so every rank gets the same
block ids and the computed payload; a store is submitted to every rank's worker and only rank 0
(the layout's elected writer) copies bytes, a load fills every rank's blocks, and a hit is
verified on every rank (through a TP-1 mapper over that rank's tensors: the MLA page is the
same at any TP). The bytes each rank's worker copied are reported (`ReplayReport.rank_bytes`).
The namespace does not depend on TP, so a persistent tier written at one TP serves another.
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import numpy as np

from kvhal.config import ConfigError, EngineConfig, host_tail_bytes, parse_config
from kvhal.engine import Direction, LayoutPlanner, Worker, build_manager, chunks_to_store, \
    leading_hits
from kvhal.hal import DeviceBackend, host_array
from kvhal.host import HostRegion, host_geometry
from kvhal.keys import ChunkKey, namespace_digest
from kvhal.layout import (CopyPlan, Kind, LayoutError, chunk_mapper, device_cache, get_layout,
                          tensor_element_bytes)
from kvhal.plugins import select_backend
from kvhal.tier import Lookup

from .device_pool import DevicePool, DevicePoolError
from .geometry import Geometry, GeometryError, MlaGeometry
from .payload import PayloadMismatchError, chunk_seed, fill_page, page_matches
from .reference import ReferenceResult
from .report import DEFAULT_PREFILL_US_PER_TOKEN, ReplayReport, TierTraffic, Timeline
from .trace import HASH_NAME, HASH_SEED, TraceRequest

#: Engine config used when none is given: a 2 GiB host tier, LRU, no secondary tier.
DEFAULT_CONFIG: dict[str, Any] = {"cpu_bytes_to_use": 2 << 30, "eviction_policy": "lru"}
#: Canonical page format of the chunks (TP 1, one contiguous page per layer).
FORMAT_ID = "kvhal-hnd-v1"
#: Seconds between polls while a secondary tier promotes a chunk (RETRY).
_RETRY_POLL_S = 50e-6


@dataclass(frozen=True, slots=True)
class ReplayOptions:
    """How to replay, besides the engine config.

    Attributes:
        geometry: Full attention or MLA (chunk bytes = chunk_tokens × geometry.bytes_per_token).
        chunk_tokens: Tokens per chunk (the trace's block).
        device_bytes: Bytes of the device KV pool (whole chunks; the rest is unused).
        backend: Device HAL backend name.
        prefill_us_per_token: Modeled prefill cost per prompt token, µs.
        time_scale: Request i starts `timestamp_ms × time_scale / 1000` s after the replay
            starts (1 = the trace's pace, 0 = as fast as possible).
        layout: Device layout of the per-layer KV tensors (a `kvhal.layout` name; None: the
            geometry's `default_layout`).
        tp: TP ranks (each its own device pool tensors and worker over one host region);
            above 1 only for an MLA geometry.
        instances: Serving instances, each with its own device pool, host tier and
            secondary tiers (`instance_configs`); request i goes to instance i mod instances.
        waiting: The trace's last `waiting` requests form a queue that never runs: before
            every replayed request each of them is looked up (on that request's instance)
            and released unscheduled, as
            vLLM asks its waiting requests every step (their tier hits start promotions:
            `Manager.max_promotions` bounds them, so they must not push out the hot chunks).
        drain_each: Wait for every secondary-tier job after each request (`Manager.drain`),
            so the hits depend on the trace alone, not on the disk's speed: without it a
            store finding every host slot still being read by a slow tier is skipped, as in
            serving (the engine never blocks), and a loaded machine then hits less.
    """

    geometry: Geometry | MlaGeometry
    chunk_tokens: int = 512
    device_bytes: int = 1 << 30
    backend: str = "cpu"
    prefill_us_per_token: float = DEFAULT_PREFILL_US_PER_TOKEN
    time_scale: float = 0.0
    layout: str | None = None
    instances: int = 1
    waiting: int = 0
    tp: int = 1
    drain_each: bool = False

    @property
    def device_layout(self) -> str:
        """The device layout in use: `layout`, or the geometry's default."""
        return self.layout or self.geometry.default_layout

    @property
    def chunk_bytes(self) -> int:
        """Canonical bytes of one chunk (all layers; `kvhal.layout.chunk_layout`)."""
        return self.chunk_tokens * self.geometry.bytes_per_token


def with_capacity(config: dict[str, Any], options: ReplayOptions, level: str,
                  nbytes: int) -> tuple[dict[str, Any], ReplayOptions]:
    """The config and options of one sweep run: `level`'s capacity set to `nbytes`.

    `level` is "device" (`device_bytes`), "host" (`cpu_bytes_to_use`) or a secondary tier type
    (its `max_bytes`). Every tier with a `root_dir` gets a fresh subdirectory per capacity, so
    sweep runs never see each other's chunks.

    Raises:
        ConfigError: `level` names no tier of the config (path "--sweep").
    """
    tiers = [dict(t) for t in config.get("secondary_tiers", [])]
    for t in tiers:
        if "root_dir" in t:
            t["root_dir"] = os.path.join(t["root_dir"], f"sweep-{level}-{nbytes}")
    config = dict(config, secondary_tiers=tiers) if tiers else dict(config)
    if level == "device":
        return config, replace(options, device_bytes=nbytes)
    if level == "host":
        return dict(config, cpu_bytes_to_use=nbytes), options
    matching = [t for t in tiers if t.get("type") == level]
    if not matching:
        raise ConfigError("--sweep", f"{level!r} is neither device, host nor a secondary tier "
                          f"type of the config ({', '.join(t.get('type', '?') for t in tiers)})")
    matching[0]["max_bytes"] = nbytes
    return config, options


def instance_configs(config: dict[str, Any], instances: int) -> list[dict[str, Any]]:
    """The engine config of each of `instances` instances.

    Every instance gets `config`; with more than one, each p2p tier entry gets its own
    listener port and every instance's p2p identity as `peers` (so each instance pulls from
    all others; its own identity is skipped), and other tiers are as configured (an fs
    `root_dir` is then shared by all instances, as instances on one node would share it).

    Raises:
        ConfigError: a p2p entry sets `port` or `peers` while instances > 1 (they are the
            replay's to set; names the key path).
    """
    if instances == 1:
        return [config]
    tiers = config.get("secondary_tiers", [])
    p2p = _p2p_entries(config)
    ports = {i: [_free_port() for _ in range(instances)] for i in p2p}
    out = []
    for n in range(instances):
        own = [dict(t) for t in tiers]
        for i in p2p:
            host = own[i].get("advertise_host", own[i].get("host", "127.0.0.1"))
            own[i] |= {"port": ports[i][n], "peers": [f"{host}:{p}" for p in ports[i]]}
        out.append(dict(config, secondary_tiers=own))
    return out


def _p2p_entries(config: dict[str, Any]) -> list[int]:
    """Positions of the p2p entries of `secondary_tiers`, checked for `instance_configs`."""
    tiers = config.get("secondary_tiers", [])
    p2p = [i for i, t in enumerate(tiers) if isinstance(t, dict) and t.get("type") == "p2p"]
    for i in p2p:
        for key in ("port", "peers"):
            if key in tiers[i]:
                raise ConfigError(f"secondary_tiers[{i}].{key}",
                                  "set by the replay for --instances > 1; leave it out")
    return p2p


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replay_namespace(options: ReplayOptions) -> bytes:
    """The namespace digest of replay chunks with this geometry and chunking (stable across
    runs, so a persistent tier is reused by the next replay of the same geometry)."""
    g = options.geometry
    return namespace_digest(weights=f"{g.model_id} payload-v1", kv_dtype=g.dtype,
                            format_id=FORMAT_ID,
                            tokens_per_chunk=options.chunk_tokens, hash_name=HASH_NAME,
                            hash_seed=HASH_SEED)


def check_replay(requests: Sequence[TraceRequest], config: dict[str, Any],
                 options: ReplayOptions) -> EngineConfig:
    """Validate a replay before anything is allocated.

    Returns:
        The parsed engine config.

    Raises:
        ConfigError: invalid config, a chunk other than the trace's block, or a p2p `port` /
            `peers` with several instances (names the key).
        LayoutError: `options.layout` is unknown or cannot store the geometry ("--layout: ...").
        GeometryError: `options.tp` > 1 with a full-attention geometry ("--tp: ...").
        DevicePoolError: a request has more full chunks than `options.device_bytes` holds.
    """
    cfg = parse_config(config)
    if options.instances > 1:
        _p2p_entries(config)
    if cfg.blocks_per_chunk_for(options.chunk_tokens) != 1:
        key = "block_size" if cfg.block_size is not None else "blocks_per_chunk"
        raise ConfigError(key, f"a replay's chunk is the trace's block ({options.chunk_tokens} "
                          "tokens): use block_size equal to it or blocks_per_chunk 1")
    spec = options.geometry.spec(options.chunk_tokens)
    if options.tp > 1 and spec.groups[0].kind is not Kind.MLA:
        raise GeometryError(f"--tp: {options.tp} needs an MLA geometry (--mla or an MLA "
                            "preset); a full-attention replay runs at TP 1")
    try:
        chunk_mapper(spec, options.device_layout, 1, 0, 1)
    except LayoutError as exc:
        # the flag names the field: "layout: unknown layout ..." becomes "--layout: unknown ..."
        raise LayoutError(f"--layout: {str(exc).removeprefix('layout: ')}",
                          field="layout") from None
    max_chunks = max((len(r.chunk_hashes) for r in requests), default=0)
    num_blocks = options.device_bytes // options.chunk_bytes
    if max_chunks > num_blocks or num_blocks == 0:
        raise DevicePoolError(f"--device-bytes: {options.device_bytes} bytes hold "
                              f"{num_blocks} chunks of {options.chunk_bytes} bytes, but a "
                              f"request has {max_chunks} full chunks")
    return cfg


class _Counters:
    """Mutable totals of one replay."""

    def __init__(self, levels: Sequence[str]):
        self.hits = {level: 0 for level in levels}
        self.d2h = [0, 0]   # chunks, bytes
        self.h2d = [0, 0]
        self.load_s = 0.0
        self.verified = 0


class _Timed:
    """Proxy that adds the wall time of each method call on `target` to `seconds`, except the
    `untimed` methods (those that block on I/O)."""

    def __init__(self, target: Any, untimed: tuple[str, ...]):
        self._target = target
        self._untimed = untimed
        self.seconds = 0.0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if name in self._untimed or not callable(attr):
            return attr

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed


@dataclass(frozen=True, slots=True)
class _LayerTensor:
    """One layer's KV tensor inside the replay's device allocation, described the way
    `kvhal.layout.device_cache` reads vLLM's (C-contiguous) torch tensors."""

    ptr: int
    shape: tuple[int, ...]
    itemsize: int

    def data_ptr(self) -> int:
        """Address of element 0."""
        return self.ptr

    def element_size(self) -> int:
        """Bytes per element."""
        return self.itemsize

    def stride(self) -> tuple[int, ...]:
        """C-contiguous strides, in elements."""
        out, step = [], 1
        for dim in reversed(self.shape):
            out.append(step)
            step *= dim
        return tuple(reversed(out))


def _issue(backend: DeviceBackend, plans: Sequence[CopyPlan], stream: Any) -> None:
    """Issue the copies of `plans` on `stream`: one batch of 2D copies, then one of the rest."""
    if not plans:
        return
    copies_2d = np.concatenate([p.copies_2d for p in plans])
    if len(copies_2d):
        backend.copy_2d_batch_async(copies_2d, stream)
    sizes = np.concatenate([p.sizes for p in plans])
    if len(sizes):
        backend.copy_batch_async(np.concatenate([p.dsts for p in plans]),
                                 np.concatenate([p.srcs for p in plans]), sizes, stream)


class _CountingPlanner:
    """A `JobPlanner` that adds the bytes of every plan it hands the worker to
    `nbytes[direction]` (a job re-planned after a fault counts again)."""

    def __init__(self, planner: LayoutPlanner):
        self.planner = planner
        self.nbytes = {d: 0 for d in Direction}

    def __call__(self, block_ids: np.ndarray, slot_addr: int, direction: Direction
                 ) -> CopyPlan:
        """See `kvhal.engine.worker.Planner`."""
        plan = self.planner(block_ids, slot_addr, direction)
        self.nbytes[direction] += plan.nbytes
        return plan

    def plan_job(self, block_ids: np.ndarray, slot_addrs: np.ndarray, direction: Direction
                 ) -> CopyPlan:
        """See `kvhal.engine.worker.JobPlanner`."""
        plan = self.planner.plan_job(block_ids, slot_addrs, direction)
        self.nbytes[direction] += plan.nbytes
        return plan


class _Rank:
    """One TP rank: its per-layer tensors in one device allocation of `num_blocks` blocks, its
    worker (planning through this rank's mapper, bytes counted) and `view`, the planner of the
    replay's own compute and verification copies (a TP-1 mapper over this rank's tensors: at
    TP > 1 only MLA runs, whose page is the same at any TP). Resources go on `closers`."""

    def __init__(self, rep: "_Replayer", spec: Any, rank: int, num_blocks: int,
                 closers: list[Callable[[], None]]):
        options, backend = rep.options, rep.backend
        layout = options.device_layout
        mapper = chunk_mapper(spec, layout, options.tp, rank, 1)
        group = spec.groups[0]
        shape = get_layout(layout).shape(group, mapper.groups[0].share.num_heads, num_blocks)
        self.device = backend.alloc_device(num_blocks * mapper.device_block_bytes)
        closers.append(lambda: backend.free(self.device))
        layer_bytes = num_blocks * mapper.device_block_bytes // spec.num_layers
        tensors = [_LayerTensor(self.device.ptr + i * layer_bytes, shape,
                                tensor_element_bytes(group)) for i in range(spec.num_layers)]
        self.planner = _CountingPlanner(LayoutPlanner(mapper, device_cache(mapper, tensors)))
        if options.tp == 1:
            self.view = self.planner.planner
        else:
            view = chunk_mapper(spec, layout, 1, 0, 1)
            self.view = LayoutPlanner(view, device_cache(view, tensors))
        self.worker = _Timed(Worker(backend, self.planner, host_ptr=rep.region.ptr,
                                    slot_bytes=rep.geometry.slot_bytes),
                             untimed=("wait", "close"))
        closers.append(self.worker.close)


class _Replayer:
    """One replay's live objects (see module docstring); `close` releases all of them."""

    def __init__(self, cfg: EngineConfig, options: ReplayOptions, backend: DeviceBackend,
                 max_chunks: int):
        self.options = options
        self.backend = backend
        spec = options.geometry.spec(options.chunk_tokens)
        chunk = chunk_mapper(spec, options.device_layout, 1, 0, 1).chunk
        self.chunk_bytes = chunk.chunk_bytes
        self.page_offsets = chunk.page_offsets
        self.page_bytes = chunk.page_bytes
        num_blocks = options.device_bytes // self.chunk_bytes
        self.pool = DevicePool(num_blocks)
        self.namespace = replay_namespace(options)
        self._closers: list[Callable[[], None]] = []
        try:
            staging_bytes = max(max_chunks, 1) * self.chunk_bytes
            self.staging = backend.alloc_pinned(staging_bytes)
            self._closers.append(lambda: backend.free(self.staging))
            self.staging_array = host_array(self.staging)
            self.compute_stream = backend.create_stream()
            self._closers.append(lambda: backend.destroy_stream(self.compute_stream))
            self.computed = backend.create_event()
            self._closers.append(lambda: backend.destroy_event(self.computed))
            self.geometry = host_geometry(self.chunk_bytes, cfg.cpu_bytes_to_use,
                                          host_tail_bytes(cfg))
            self.region = HostRegion.allocate(backend, self.geometry)
            self._closers.append(self.region.close)
            self.manager = _Timed(build_manager(cfg, self.geometry, self.region.view,
                                                self.namespace, emit_events=False),
                                  untimed=("drain", "close"))
            self._closers.append(self.manager.close)
            self.ranks = [_Rank(self, spec, r, num_blocks, self._closers)
                          for r in range(options.tp)]
        except BaseException:
            self.close()
            raise
        self.host_capacity_bytes = self.geometry.nbytes
        self.max_offload_tokens = cfg.max_offload_tokens
        names = [t.name for t in self.manager.tiers]
        #: Report level of each secondary tier: its type name, "name[i]" if the type repeats.
        self.tier_names = [name if names.count(name) == 1 else f"{name}[{i}]"
                           for i, name in enumerate(names)]

    def close(self) -> None:
        """Drain and release everything, newest first (tiers keep what they persisted)."""
        while self._closers:
            self._closers.pop()()

    # -- the engine's jobs, on every rank -----------------------------------------------------
    def run_job(self, direction: Direction, job_id: int, blocks: np.ndarray,
                slots: np.ndarray) -> int:
        """Submit job `job_id` to every rank's worker (stores after `self.computed`), wait for
        all; the chunks that arrived on every rank (the smallest `num_ok`)."""
        for rank in self.ranks:
            if direction is Direction.D2H:
                rank.worker.submit_store(job_id, blocks, slots, after=self.computed)
            else:
                rank.worker.submit_load(job_id, blocks, slots)
        return min(_wait(rank.worker, job_id) for rank in self.ranks)

    @property
    def worker_seconds(self) -> float:
        """Time inside the ranks' worker calls, summed."""
        return sum(rank.worker.seconds for rank in self.ranks)

    # -- byte movement outside the engine (compute and verification) -------------------------
    def _copy_blocks(self, rank: _Rank, blocks: Sequence[int], direction: Direction) -> None:
        """Move chunk i of the staging buffer to/from `rank`'s device block `blocks[i]`."""
        base = self.staging.ptr
        _issue(self.backend, [rank.view(np.array([b], dtype=np.int64),
                                        base + i * self.chunk_bytes, direction)
                              for i, b in enumerate(blocks)], self.compute_stream)

    def _chunk_pages(self, i: int) -> list[np.ndarray]:
        base = i * self.chunk_bytes
        return [self.staging_array[base + int(o): base + int(o) + int(n)]
                for o, n in zip(self.page_offsets, self.page_bytes)]

    def compute(self, keys: Sequence[ChunkKey], blocks: Sequence[int]) -> None:
        """Write the payload of `keys` into device `blocks` of every rank; records
        `self.computed` after."""
        for i, key in enumerate(keys):
            seed = chunk_seed(key.to_bytes())
            for p, page in enumerate(self._chunk_pages(i)):
                fill_page(page, seed, p)
        for rank in self.ranks:
            self._copy_blocks(rank, blocks, Direction.H2D)
        self.backend.record_event(self.computed, self.compute_stream)

    def verify(self, keys: Sequence[ChunkKey], blocks: Sequence[int], line: int,
               level: Sequence[str]) -> None:
        """Copy device `blocks` of each rank back and check each holds its key's payload.

        Raises:
            PayloadMismatchError: names the trace line, chunk, key, the level it came from and
                (TP > 1) the rank.
        """
        for r, rank in enumerate(self.ranks):
            self._copy_blocks(rank, blocks, Direction.D2H)
            self.backend.stream_synchronize(self.compute_stream)
            where = f" on TP rank {r}" if len(self.ranks) > 1 else ""
            for i, key in enumerate(keys):
                seed = chunk_seed(key.to_bytes())
                for p, page in enumerate(self._chunk_pages(i)):
                    if not page_matches(page, seed, p):
                        raise PayloadMismatchError(
                            f"trace line {line}: chunk {i} ({key.hex()}) from {level[i]} holds "
                            f"wrong bytes in page {p} (device block {blocks[i]}{where})")


def run_replay(requests: Sequence[TraceRequest], reference: ReferenceResult,
               config: dict[str, Any], options: ReplayOptions, trace: str = "",
               on_request: Callable[[], None] | None = None) -> ReplayReport:
    """Replay `requests` through a fresh engine (see module docstring) and report.

    Args:
        requests: From `read_trace`, in order (the last `options.waiting` are the waiting
            queue, not replayed).
        reference: `reference_hits` of the replayed requests (reported alongside).
        config: Engine config (DESIGN §7 JSON object); its chunk must be the trace's block.
        options: Geometry, device pool, backend, prefill model, pacing.
        trace: Trace path, for the report.
        on_request: Called after each request (progress bars).

    Returns:
        The report; the engine, tiers and buffers are closed (persistent tiers keep their data).

    Raises:
        ConfigError, DevicePoolError: see `check_replay`.
        PayloadMismatchError: a hit chunk held wrong bytes.
        HalError: the backend failed.
    """
    cfg = check_replay(requests, config, options)
    backend = select_backend(options.backend)
    max_chunks = max((len(r.chunk_hashes) for r in requests), default=0)
    reps: list[_Replayer] = []
    try:
        for instance_config in instance_configs(config, options.instances):
            reps.append(_Replayer(parse_config(instance_config), options, backend, max_chunks))
    except BaseException:
        for rep in reps:
            rep.close()
        raise
    levels = ["device", "host", *reps[0].tier_names]
    counters = _Counters(levels)
    queue = [[ChunkKey(reps[0].namespace, 0, h) for h in req.chunk_hashes]
             for req in requests[len(requests) - options.waiting:]] if options.waiting else []
    requests = requests[:len(requests) - len(queue)]
    n = len(requests)
    times = np.zeros(n)
    inputs = np.zeros(n, dtype=np.int64)
    hits = np.zeros(n, dtype=np.int64)
    saved = np.zeros(n)
    t_start = time.perf_counter()
    try:
        tier_stats_before = [[dict(t.stats()) for t in rep.manager.tiers] for rep in reps]
        _settle(reps)
        for r, req in enumerate(requests):
            manager = reps[r % len(reps)].manager
            for q, keys in enumerate(queue):       # asked about, not scheduled
                manager.lookup(keys, pin_owner=("waiting", q))
                manager.release(("waiting", q))
            if options.time_scale > 0:
                delay = t_start + req.timestamp_ms * options.time_scale / 1000 - \
                    time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
            hit_chunks, load_s = _replay_request(reps[r % len(reps)], req, r, counters)
            if options.drain_each:
                for rep in reps:
                    rep.manager.drain()
            _settle(reps)
            times[r], inputs[r] = req.timestamp_ms / 1000, req.input_tokens
            hits[r] = hit_chunks * options.chunk_tokens
            saved[r] = hits[r] * options.prefill_us_per_token * 1e-6 - load_s
            if on_request is not None:
                on_request()
        for rep in reps:
            rep.manager.drain()
        traffic = _traffic(reps, counters, tier_stats_before)
    finally:
        for rep in reps:
            rep.close()
    wall_s = time.perf_counter() - t_start
    rep = reps[0]
    capacities: dict[str, int | None] = {"device": rep.pool.num_blocks * rep.chunk_bytes,
                                         "host": rep.host_capacity_bytes}
    for tier_cfg, name in zip(cfg.secondary_tiers, rep.tier_names):
        capacities[name] = tier_cfg.options.get("max_bytes")
    return ReplayReport(
        trace=trace, capacities=capacities, chunk_tokens=options.chunk_tokens,
        chunk_bytes=rep.chunk_bytes, requests=n, input_tokens=int(inputs.sum()),
        hit_tokens={k: v * options.chunk_tokens for k, v in counters.hits.items()},
        traffic=traffic, reference=reference, wall_s=wall_s,
        manager_s=sum(r.manager.seconds for r in reps),
        worker_s=sum(r.worker_seconds for r in reps), load_s=counters.load_s,
        verified_chunks=counters.verified, prefill_us_per_token=options.prefill_us_per_token,
        ttft_saved_s=float(saved.sum()), timeline=Timeline(times, inputs, hits, saved),
        instances=len(reps), tp=options.tp,
        geometry=options.geometry.as_dict() | {"layout": options.device_layout},
        rank_bytes=[{d.value: sum(r.ranks[k].planner.nbytes[d] for r in reps)
                     for d in (Direction.D2H, Direction.H2D)} for k in range(options.tp)])


#: Seconds the replay waits for instances' p2p directories to catch up between requests.
SETTLE_TIMEOUT_S = 30.0


def _settle(reps: Sequence[_Replayer]) -> None:
    """Wait until every instance's p2p tiers have applied what the other instances' p2p tiers
    announced (so p2p hits depend on the trace, not on feed timing).

    Raises:
        TimeoutError: not in step within `SETTLE_TIMEOUT_S`.
    """
    if len(reps) < 2:
        return
    from kvhal.tiers.p2p import P2PTier  # the p2p extra, only when instances share one
    tiers = [[t for t in rep.manager.tiers if isinstance(t, P2PTier)] for rep in reps]
    pairs = [(mine[k], theirs[k]) for a, mine in enumerate(tiers)
             for b, theirs in enumerate(tiers) if a != b for k in range(len(mine))]
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while not all(mine.in_step_with(theirs) for mine, theirs in pairs):
        if time.monotonic() > deadline:
            raise TimeoutError(f"p2p directories of the replay's instances did not catch up "
                               f"within {SETTLE_TIMEOUT_S} s")
        time.sleep(_RETRY_POLL_S)


def _traffic(reps: Sequence[_Replayer], c: _Counters, before: list[list[dict]]
             ) -> dict[str, dict[str, TierTraffic]]:
    out = {"host": {"d2h": TierTraffic(*c.d2h), "h2d": TierTraffic(*c.h2d)}}
    chunk_bytes = reps[0].chunk_bytes
    for k, name in enumerate(reps[0].tier_names):
        moved = {}
        for direction, stat in (("store", "bytes_stored"), ("load", "bytes_loaded")):
            nbytes = sum(int(rep.manager.tiers[k].stats().get(stat, 0)) - int(old[k].get(stat, 0))
                         for rep, old in zip(reps, before))
            moved[direction] = TierTraffic(nbytes // chunk_bytes, nbytes)
        out[name] = moved
    return out


def _resolve_lookup(rep: _Replayer, keys: Sequence[ChunkKey], rid: int
                    ) -> tuple[int, list[str]]:
    """Lookup until no RETRY precedes the first MISS.

    Returns:
        (leading hits, level of each key at the first lookup that did not answer it MISS):
        "host" for a HIT, the first secondary tier holding it for a RETRY (a promotion; asked
        again while a tier answers RETRY itself), "" for a key answered MISS throughout. A key behind a MISS is answered MISS unseen, so it
        gets its level once that MISS resolves (a landed promotion freed a slot).
    """
    manager = rep.manager
    answers = manager.lookup(keys, pin_owner=rid)
    levels = [""] * len(keys)
    while True:
        for i, a in enumerate(answers):
            if not levels[i] and a is not Lookup.MISS:
                levels[i] = "host" if a is Lookup.HIT else _tier_of(rep, keys[i])
        n = leading_hits(answers)
        if n is not None:
            return n, levels
        time.sleep(_RETRY_POLL_S)
        answers = manager.lookup(keys, pin_owner=rid)


def _tier_of(rep: _Replayer, key: ChunkKey) -> str:
    """The first secondary tier holding `key`; "" while a tier does not know yet (RETRY: its
    check of its store is pending, e.g. mooncake); "host" if none holds it (a store still in
    flight)."""
    for tier, name in zip(rep.manager.tiers, rep.tier_names):
        answer = tier.lookup(key)
        if answer is Lookup.HIT:
            return name
        if answer is Lookup.RETRY:
            return ""
    return "host"


def _wait(worker: Any, job_id: int) -> int:
    """Block until `worker`'s job `job_id` ends; its number of chunks that arrived."""
    worker.wait(job_id)
    results = worker.get_finished()
    (result,) = [r for r in results if r.job_id == job_id]
    return result.num_ok


def _replay_request(rep: _Replayer, req: TraceRequest, rid: int,
                    c: _Counters) -> tuple[int, float]:
    """Replay one request; returns (hit chunks, load seconds)."""
    hashes = req.chunk_hashes
    if not hashes:
        return 0, 0.0
    ns = rep.namespace
    d = rep.pool.match_prefix(hashes)
    keys = [ChunkKey(ns, 0, h) for h in hashes[d:]]
    t_load = time.perf_counter()
    n_hit, levels = _resolve_lookup(rep, keys, rid) if keys else (0, [])
    blocks = rep.pool.acquire(hashes, d)
    tail = blocks[d:]
    manager = rep.manager
    loaded = 0
    plan = manager.prepare_load(keys[:n_hit], pin_owner=rid) if n_hit else None
    if plan is None:
        manager.release(rid)
    else:
        ids = np.asarray(tail[:len(plan.keys)], dtype=np.int64).reshape(-1, 1)
        loaded = rep.run_job(Direction.H2D, plan.job_id, ids, plan.slots)
        manager.complete_load(plan.job_id, loaded)
        c.h2d[0] += loaded
        c.h2d[1] += loaded * rep.chunk_bytes
    load_s = time.perf_counter() - t_load
    c.load_s += load_s
    sources = levels[:loaded]
    for level in sources:
        c.hits[level] += 1
    c.hits["device"] += d
    device_keys = [ChunkKey(ns, 0, h) for h in hashes[:d]]
    rep.verify(device_keys + keys[:loaded], blocks[:d + loaded], req.line,
               ["device"] * d + sources)
    c.verified += d + loaded
    _prefill_and_store(rep, req, keys, tail, d, loaded, c)
    rep.pool.release(hashes, blocks, len(hashes))
    manager.take_events()  # a serving engine forwards KV events each step; a replay drops them
    return d + loaded, load_s


def _prefill_and_store(rep: _Replayer, req: TraceRequest, keys: list[ChunkKey],
                       blocks: list[int], d: int, loaded: int, c: _Counters) -> None:
    """Compute chunks `loaded..` of `keys` (the request's chunks after its `d` device hits)
    into `blocks` and store the ones `chunks_to_store` says are due."""
    if loaded == len(keys):
        return
    rep.compute(keys[loaded:], blocks[loaded:])
    due = chunks_to_store(req.input_tokens, d + loaded, rep.options.chunk_tokens,
                          rep.max_offload_tokens)
    first = due.start - d
    plan = rep.manager.prepare_store(keys[first:due.stop - d]) if len(due) else None
    if plan is not None:
        ids = np.asarray(blocks, dtype=np.int64)[first + plan.indices].reshape(-1, 1)
        num_ok = rep.run_job(Direction.D2H, plan.job_id, ids, plan.slots)
        rep.manager.complete_store(plan.job_id, num_ok)
        c.d2h[0] += num_ok
        c.d2h[1] += num_ok * rep.chunk_bytes
    rep.backend.stream_synchronize(rep.compute_stream)
