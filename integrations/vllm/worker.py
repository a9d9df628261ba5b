"""The connector's worker side: maps one TP rank's KV tensors and runs its transfer jobs.

Runs in each vLLM worker process. `register_kv_caches` describes the rank's per-layer KV
tensors through `kvhal.layout` (vLLM-CPU's layout, the rank's heads of the canonical page) and
registers their memory with the HAL backend of their device. Jobs arrive in `KVHalMetadata`;
the kvhal engine's `Worker` executes them on its own load and store streams. The host region is
the scheduler's shared region (`HostRegion.attach_shared`), attached on first use.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from kvhal import plugins
from kvhal.engine import Direction, Worker
from kvhal.host import HostGeometry, HostRegion
from kvhal.layout import chunk_mapper, device_cache, plan_copies

from .geometry import Deployment, device_layout_name
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
    """

    def __init__(self, deployment: Deployment, tp_rank: int):
        self.deployment = deployment
        self.tp_rank = tp_rank
        self.backend: Any = None
        self.worker: Worker | None = None
        self.region: HostRegion | None = None
        self._planner: Any = None
        self._registered: list = []
        self._store_reqs: dict[int, str] = {}      # in-flight store job → request id
        self._report: set[str] = set()
        self._loads_waiting: list[int] = []
        self._load_errors: set[int] = set()
        self._meta = KVHalWorkerMetadata()

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Map this rank's KV tensors (vLLM's `register_kv_caches` argument).

        Raises:
            kvhal.layout.LayoutError: the tensors do not hold the layout their shape implies.
            KeyError: a layer vLLM configured is missing from `kv_caches`.
        """
        dep = self.deployment
        tensors = [kv_caches[name] for name in dep.layer_names]
        layout = device_layout_name(tensors[0])
        self.backend = plugins.select_backend(backend_name(tensors[0].device.type))
        if tensors[0].device.type == "cpu":
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                        for t in tensors}
            self._registered = [self.backend.register_host(p, n) for p, n in storages.items()]
        mapper = chunk_mapper(dep.spec, layout, dep.tp_size, self.tp_rank, dep.blocks_per_chunk)
        device = device_cache(mapper, tensors)

        def planner(block_ids: np.ndarray, slot_addr: int, direction: Direction):
            return plan_copies(mapper, block_ids, device, slot_addr, _DIRECTIONS[direction])

        self._planner = planner

    def _attach(self, info: RegionInfo) -> Worker:
        if self.worker is None:
            geometry = HostGeometry(info.slot_bytes, info.chunk_nbytes, info.capacity)
            self.region = HostRegion.attach_shared(self.backend, info.share_path, geometry)
            self.worker = Worker(self.backend, self._planner, host_ptr=self.region.ptr,
                                 slot_bytes=info.slot_bytes)
        return self.worker

    # -- per step ----------------------------------------------------------------------------
    def handle_preemptions(self, meta: KVHalMetadata) -> None:
        """Before preempted blocks are reused: wait for every in-flight store."""
        if meta.flush and self.worker is not None:
            self.worker.wait()

    def start_load_kv(self, meta: KVHalMetadata) -> None:
        """Issue this step's loads. Chunks the scheduler could not hold (slot -1) and every
        chunk after them fail at once: their blocks are reported as load errors."""
        worker = self._attach(meta.region)
        self._report.update(meta.report_sending)
        for job in meta.loads:
            valid = int(np.argmin(job.slots >= 0)) if (job.slots < 0).any() else len(job.slots)
            self._load_errors.update(job.block_ids[valid:].ravel().tolist())
            if job.job_id >= 0:
                worker.submit_load(job.job_id, job.block_ids[:valid], job.slots[:valid])
                self._loads_waiting.append(job.job_id)

    def wait_for_layer_load(self) -> None:
        """Block until this step's loads have landed (the first layer's attention needs them;
        one plan moves every layer of a chunk, so the first wait covers all layers)."""
        while self._loads_waiting:
            self.worker.wait(self._loads_waiting.pop())

    def wait_for_save(self, meta: KVHalMetadata) -> None:
        """Start this step's stores. On the cpu backend the forward pass has finished writing
        the KV when vLLM calls this, so no compute event is needed."""
        self.wait_for_layer_load()
        if not meta.stores:
            return
        worker = self._attach(meta.region)
        for job in meta.stores:
            worker.submit_store(job.job_id, job.block_ids, job.slots)
            self._store_reqs[job.job_id] = job.req_id

    def get_finished(self) -> set[str]:
        """Collect finished jobs into the worker metadata; return the delayed-free requests
        with no store of this rank still reading their blocks (vLLM's `finished_sending`)."""
        if self.worker is None:
            return set()
        for result in self.worker.get_finished():
            self._meta.ranks_done[result.job_id] = 1
            self._meta.num_ok[result.job_id] = result.num_ok
            self._store_reqs.pop(result.job_id, None)
            if result.direction is Direction.H2D and not result.ok:
                self._load_errors.update(result.block_ids[result.num_ok:].ravel().tolist())
        busy = set(self._store_reqs.values())
        done = {r for r in self._report if r not in busy}
        self._report -= done
        return done

    def take_load_errors(self) -> set[int]:
        """Device block ids whose load failed since the last call (vLLM recomputes them)."""
        out, self._load_errors = self._load_errors, set()
        return out

    def take_worker_meta(self) -> KVHalWorkerMetadata | None:
        """Job completions since the last call, or None if there are none."""
        if not self._meta.ranks_done:
            return None
        out, self._meta = self._meta, KVHalWorkerMetadata()
        return out

    def close(self) -> None:
        """Wait for every job, then release streams, the region and the registrations."""
        if self.worker is not None:
            self.worker.close()
        if self.region is not None:
            self.region.close()
        for allocation in self._registered:
            self.backend.free(allocation)
        self._registered = []
