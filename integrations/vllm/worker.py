"""The connector's worker side: maps one TP rank's KV tensors and runs its transfer jobs.

Runs in each vLLM worker process. `register_kv_caches` describes the rank's per-layer KV
tensors of every KV cache group through `kvhal.layout` (vLLM-CPU's attention layout or the MLA
latent layout, the rank's heads of the canonical page) and registers their memory with the HAL
backend of their device. Jobs arrive in `KVHalMetadata`, each for one group; one kvhal engine
`Worker` per group executes them on its own load and store streams, into that group's pool of
the host region (the scheduler's shared region, `HostRegion.attach_shared`, attached on first
use).

Ordering against the forward (`compute.ComputeStream`): stores wait on an event recorded on the
compute stream (torch's current stream on CUDA/ROCm) when `wait_for_save` starts them, after
the layers that wrote their KV; synchronous loads (`KVHalMetadata.loads`) hold up attention
through a wait queued on the compute stream in `wait_for_layer_load` (vLLM-CPU, whose forward
runs on the host: the host blocks there). `wait_for_save` then blocks the host until they have
ended, so their failed blocks are in `take_load_errors` when vLLM asks.

Asynchronous loads (`KVHalMetadata.async_loads`) run beside the forward; a request is reported
in `finished_recving` once the scheduler said its load is final and all its jobs have ended on
this rank. Their outcome (`num_ok` per job) reaches the scheduler side through
the worker metadata, which cuts the request back if a chunk failed (never `failed_recving`).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from kvhal import plugins
from kvhal.engine import Direction, Worker
from kvhal.host import HostRegion
from kvhal.layout import Kind, LayoutError, chunk_mapper, device_cache, plan_copies

from .compute import ComputeStream, compute_stream
from .geometry import Deployment, UnsupportedModelError, state_layout_name
from .views import backend_of, view_layout
from .metadata import KVHalMetadata, KVHalWorkerMetadata, RegionInfo

_DIRECTIONS = {Direction.D2H: "d2h", Direction.H2D: "h2d"}


def backend_name(device_type: str) -> str:
    """The kvhal backend for a torch device type ("cpu", "cuda"; ROCm torch reports "cuda")."""
    if device_type == "cuda":
        import torch

        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    return device_type


class WorkerSide:
    """Worker-side state of one `KVHalConnector` on one TP rank.

    Args:
        deployment: Geometry and namespace (`geometry.deployment`).
        tp_rank: This worker's tensor-parallel rank.
        compute: Makes the `ComputeStream` of the forward from the KV tensors' backend (called
            once, on first use; default `compute.compute_stream`).
    """

    def __init__(self, deployment: Deployment, tp_rank: int,
                 compute: Callable[[Any], ComputeStream] = compute_stream):
        self.deployment = deployment
        self.tp_rank = tp_rank
        self.backend: Any = None
        self.workers: list[Worker] = []
        self.compute: ComputeStream | None = None
        self._make_compute = compute
        self.region: HostRegion | None = None
        self._planners: list[Any] = []
        self._layers: Mapping[str, Any] = {}
        self._registered: list = []
        self._store_reqs: dict[int, str] = {}      # in-flight store job → request id
        self._report: set[str] = set()
        self._loads_waiting: list[tuple[int, int]] = []   # (group, job id): sync, not ordered
        self._loads_ordered: list[tuple[int, int]] = []   # ordered before attention, not ended
        self._load_errors: set[int] = set()
        self._async_jobs: dict[int, tuple[int, str]] = {}   # in-flight → (group, request)
        self._recv_final: set[str] = set()          # no more jobs will come for these
        self._meta = KVHalWorkerMetadata()
        self._asleep: dict[str, int] | None = None   # layer → address while vLLM sleeps

    def register_kv_caches(self, kv_caches: dict[str, Any],
                           layers: Mapping[str, Any] | None = None) -> None:
        """Map this rank's KV tensors (vLLM's `register_kv_caches` argument), group by group.

        Args:
            kv_caches: vLLM's per-layer KV tensors by layer name.
            layers: vLLM's attention layers by name (`static_forward_context`): on vLLM >= 0.33
                each layer's `attn_backend` says how it reads its view (`views.view_layout`).

        Raises:
            kvhal.layout.LayoutError: the tensors do not hold the layout their shape implies.
            UnsupportedModelError: a tensor with no known layout, a backend kvhal has not
                mapped or a view vLLM's layout contradicts (names the layer and backend).
            KeyError: a layer vLLM configured is missing from `kv_caches`.
        """
        self._layers = layers or {}
        dep = self.deployment
        first = kv_caches[dep.groups[0].layer_names[0]]
        self.backend = plugins.select_backend(backend_name(first.device.type))
        if first.device.type == "cpu":
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                        for t in kv_caches.values()}
            self._registered = [self.backend.register_host(p, n) for p, n in storages.items()]
        self._planners = [self._planner(g, [kv_caches[name] for name in g.layer_names])
                          for g in dep.groups]

    def _planner(self, group, tensors: list) -> Any:
        dep, name = self.deployment, group.layer_names[0]
        if group.kind is Kind.MAMBA:
            layout, backend = state_layout_name(tensors[0]), "-"
        elif dep.vllm_layout is None:
            raise UnsupportedModelError(
                f"kv_cache_groups[{group.group_id}] (layer {name}): vLLM resolved no KV cache "
                "layout (KVCacheConfig.kv_cache_layout), so kvhal cannot tell how its KV views "
                "are laid out; kvhal runs on vLLM-CPU 0.32 and vLLM >= 0.33")
        else:
            row = group.spec.groups[0].row_bytes
            backend = backend_of(self._layers.get(name))
            layout = view_layout(name, tensors[0], dep.vllm_layout, backend, dep.block_size, row)
            for other, tensor in zip(group.layer_names[1:], tensors[1:]):
                theirs = backend_of(self._layers.get(other))
                if view_layout(other, tensor, dep.vllm_layout, theirs, dep.block_size,
                               row) != layout:
                    raise UnsupportedModelError(
                        f"kv_cache_groups[{group.group_id}]: layer {other} ({theirs}) lays "
                        f"out its KV otherwise than layer {name} ({backend}); kvhal maps one "
                        "layout per group")
        try:
            mapper = chunk_mapper(group.spec, layout, dep.tp_size, self.tp_rank,
                                  dep.blocks_per_chunk)
            device = device_cache(mapper, tensors)
        except LayoutError as exc:
            raise UnsupportedModelError(
                f"kv_cache_groups[{group.group_id}] (layer {name}, {backend}, vLLM layout "
                f"{dep.vllm_layout}, shape {tuple(tensors[0].shape)}): {exc}") from None

        def planner(block_ids: np.ndarray, slot_addr: int, direction: Direction):
            return plan_copies(mapper, block_ids, device, slot_addr, _DIRECTIONS[direction])

        return planner

    def _attach(self, info: RegionInfo) -> list[Worker]:
        if not self.workers:
            layout = info.layout
            self.region = HostRegion.attach_shared(self.backend, info.share_path, layout)
            self.workers = [Worker(self.backend, planner, host_ptr=self.region.ptr + offset,
                                   slot_bytes=pool.slot_bytes)
                            for planner, pool, offset in zip(self._planners, layout.pools,
                                                             layout.offsets)]
            self._first_slots = layout.first_slots
            self.compute = self._make_compute(self.backend)
        return self.workers

    # -- per step ----------------------------------------------------------------------------
    def handle_preemptions(self, meta: KVHalMetadata) -> None:
        """Before preempted blocks are reused: wait for every in-flight store."""
        if meta.flush:
            for worker in self.workers:
                worker.wait()

    def start_load_kv(self, meta: KVHalMetadata) -> None:
        """Issue this step's loads, each behind an event recorded on the compute stream now:
        work queued there before (an earlier step's attention still reading blocks vLLM has
        since freed and handed to these loads) runs before a load overwrites them. Chunks of
        a synchronous load the scheduler could not hold (slot -1) and every chunk after them
        fail at once: their blocks are reported as load errors. Asynchronous loads are issued
        without being waited for.

        Where the forward runs on a stream, the compute stream is made to wait for the
        synchronous loads here, before vLLM queues the forward, not first in
        `wait_for_layer_load`: vLLM's full CUDA graphs (its default FULL_AND_PIECEWISE mode
        replays one for a batch of 1-token steps, e.g. a request whose every full chunk hit)
        replay without the per-layer calls (`KVConnectorBase_V1.requires_piecewise_for_cudagraph`,
        vLLM 0.33), so attention would read the blocks before their copies landed. Without a
        stream (vLLM-CPU: no graphs) the host blocks in `wait_for_layer_load`."""
        workers = self._attach(meta.region)
        self._report.update(meta.report_sending)
        after = self.compute.record() if meta.async_loads or meta.loads else None
        for job in meta.async_loads:
            workers[job.group].submit_load(job.job_id, job.block_ids,
                                           job.slots - self._first_slots[job.group],
                                           after=after)
            self._async_jobs[job.job_id] = (job.group, job.req_id)
        self._recv_final.update(meta.recv_final)
        for job in meta.loads:
            valid = int(np.argmin(job.slots >= 0)) if (job.slots < 0).any() else len(job.slots)
            self._load_errors.update(job.block_ids[valid:].ravel().tolist())
            if job.job_id < 0:
                continue
            local = job.slots[:valid] - self._first_slots[job.group]
            workers[job.group].submit_load(job.job_id, job.block_ids[:valid], local,
                                           after=after)
            self._loads_waiting.append((job.group, job.job_id))
        if self.compute.streamed:
            self.wait_for_layer_load()

    def wait_for_layer_load(self) -> None:
        """Before attention reads this step's synchronously loaded blocks: order the forward's
        later work after their copies (`ComputeStream.wait_job`: a wait on the compute stream,
        already queued by `start_load_kv`, or on vLLM-CPU the host blocks until they have
        landed). The first layer's call covers every layer: one plan moves every layer of a
        chunk."""
        while self._loads_waiting:
            group, job_id = self._loads_waiting.pop()
            self.compute.wait_job(self.workers[group], job_id)
            self._loads_ordered.append((group, job_id))

    def wait_for_save(self, meta: KVHalMetadata) -> None:
        """After the step's forward was queued: block until its synchronous loads have ended
        (the forward waits for them anyway; their failed blocks must reach `take_load_errors`),
        then start its stores, each behind an event recorded on the compute stream now, after
        the layers that wrote their KV (on vLLM-CPU the forward has finished: no event)."""
        self.wait_for_layer_load()
        while self._loads_ordered:
            group, job_id = self._loads_ordered.pop()
            self.workers[group].wait(job_id)
        if not meta.stores:
            return
        workers = self._attach(meta.region)
        after = self.compute.record()
        for job in meta.stores:
            workers[job.group].submit_store(job.job_id, job.block_ids,
                                            job.slots - self._first_slots[job.group],
                                            after=after)
            self._store_reqs[job.job_id] = job.req_id

    def get_finished(self) -> tuple[set[str], set[str]]:
        """Collect finished jobs into the worker metadata.

        Returns:
            (sending, recving): delayed-free requests with no store of this rank still
            reading their blocks (vLLM's `finished_sending`); asynchronous loads that got
            their last job and whose jobs on this rank have all ended (`finished_recving`;
            waiting for them here is a host → device copy, never disk or network I/O).
        """
        final = self._recv_final
        for job_id, (group, req_id) in list(self._async_jobs.items()):
            if req_id in final:
                self.workers[group].wait(job_id)
        for worker in self.workers:
            for result in worker.get_finished():
                self._meta.ranks_done[result.job_id] = 1
                self._meta.num_ok[result.job_id] = result.num_ok
                self._store_reqs.pop(result.job_id, None)
                if self._async_jobs.pop(result.job_id, None) is not None:
                    continue   # the scheduler side judges an async load's num_ok
                if result.direction is Direction.H2D and not result.ok:
                    self._load_errors.update(result.block_ids[result.num_ok:].ravel().tolist())
        busy = set(self._store_reqs.values())
        sending = {r for r in self._report if r not in busy}
        self._report -= sending
        loading = {r for _, r in self._async_jobs.values()}
        recving = {r for r in final if r not in loading}
        self._recv_final -= recving
        return sending, recving

    def take_load_errors(self) -> set[int]:
        """Device block ids whose synchronous load failed since the last call (vLLM
        recomputes them)."""
        out, self._load_errors = self._load_errors, set()
        return out

    def take_worker_meta(self) -> KVHalWorkerMetadata | None:
        """Job completions since the last call, or None if there are none."""
        if not self._meta.ranks_done:
            return None
        out, self._meta = self._meta, KVHalWorkerMetadata()
        return out

    def close(self) -> None:
        """Wait for every job, then release streams, the compute event, the region and the
        registrations."""
        for worker in self.workers:
            worker.close()
        if self.compute is not None:
            self.compute.close()
        if self.region is not None:
            self.region.close()
        for allocation in self._registered:
            self.backend.free(allocation)
        self._registered = []

    # -- sleep mode (vLLM >= 0.33: `unregister_kv_caches` / `restore_kv_caches`) -------------
    def unregister_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Before vLLM's sleep discards or remaps the device KV cache: wait for every job of
        every group that reads it (stores) or writes it (loads), so no copy touches that
        memory after this returns, and note where each tensor lives. kvhal holds no
        registration of device memory (its copy plans hold raw addresses), so this drain is
        all there is to undo. Results stay queued for the next `get_finished`. Idempotent.

        Args:
            kv_caches: The tensors given to `register_kv_caches`.
        """
        for worker in self.workers:
            worker.wait()
        if self._asleep is None:
            self._asleep = {name: t.data_ptr() for name, t in kv_caches.items()}

    def restore_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """After vLLM's wake-up: check that every KV tensor is back at its address from before
        the sleep (vLLM's CuMem allocator maps the same virtual addresses again), since the
        copy plans built by `register_kv_caches` address it there. Idempotent.

        Raises:
            RuntimeError: a tensor moved (names the layer and both addresses); kvhal would
                copy into memory that is no longer the KV cache.
        """
        if self._asleep is None:
            return
        for name, addr in self._asleep.items():
            now = kv_caches[name].data_ptr()
            if now != addr:
                raise RuntimeError(f"{name}: KV cache moved from {addr:#x} to {now:#x} across "
                                   "sleep; kvhal's copy plans address the old memory")
        self._asleep = None
