"""`KVHalConnector`: kvhal as a vLLM KV connector (vLLM `KVConnectorBase_V1`, vLLM 0.32-0.34).

Select it with `kv_transfer_config={"kv_connector": "KVHalConnector", "kv_role": "kv_both",
"kv_connector_extra_config": {...kvhal config, DESIGN §7...}}` (the `vllm.general_plugins`
entry point registers the name) or add `"kv_connector_module_path":
"kvhal.integrations.vllm.connector"`. Per request, `SamplingParams(extra_args=
{"kv_transfer_params": {"max_offload_tokens": N}})` caps what is stored.

vLLM builds one instance per role: SCHEDULER in the engine core (`SchedulerSide`) and WORKER in
each worker process (`WorkerSide`); this class only routes vLLM's hooks to them. It implements
vLLM's `SupportsHMA`, so vLLM keeps its hybrid KV cache manager on: models with several KV cache
groups (interleaved sliding-window + full attention, attention + Mamba / linear-attention state,
...) run with per-group block ids.
"""
from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata,
                                                               KVConnectorRole,
                                                               SupportsHMA)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvhal.config import parse_config

from .events import group_specs
from .geometry import check_kv_scales, deployment
from .identity import cache_namespace
from .metadata import KVHalMetadata, KVHalWorkerMetadata
from .scheduler import SchedulerSide
from .spin import bound_reader_spin
from .stats import KVHalPromMetrics, KVHalStats
from .worker import WorkerSide


class KVHalConnector(KVConnectorBase_V1, SupportsHMA):
    """kvhal's vLLM connector (see the module docstring).

    Args (from vLLM):
        vllm_config: The engine's `VllmConfig`; `kv_transfer_config.kv_connector_extra_config`
            is the kvhal config.
        role: SCHEDULER or WORKER.
        kv_cache_config: vLLM's `KVCacheConfig` (its KV cache groups).

    Raises:
        kvhal.config.ConfigError: the extra config is invalid (message names the key path).
        UnsupportedModelError: a KV cache group kvhal does not map (the message names the
            group, its first layer and its spec type; `geometry.group_spec`).
    """

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a dropped store is a future miss, not lost data."""
        return False

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        super().__init__(vllm_config, role, kv_cache_config)
        bound_reader_spin()   # a waiting engine's idle steps must not keep a core (spin.py)
        transfer = vllm_config.kv_transfer_config
        config = parse_config(dict(transfer.kv_connector_extra_config or {}))
        groups = kv_cache_config.kv_cache_groups
        dep = deployment(vllm_config, kv_cache_config,
                         config.blocks_per_chunk_for(groups[0].kv_cache_spec.block_size
                                                     if groups else 1))
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            kv_events = vllm_config.kv_events_config
            self.scheduler_side = SchedulerSide(
                dep, config, transfer.engine_id, cache_namespace(vllm_config, dep, config),
                kv_events=bool(kv_events and kv_events.enable_kv_cache_events),
                data_parallel_index=vllm_config.parallel_config.data_parallel_index,
                group_specs=group_specs(kv_cache_config))
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.worker_side = WorkerSide(dep, get_tensor_model_parallel_rank())

    # -- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Map this rank's per-layer KV tensors into canonical pages.

        Raises:
            UnsupportedModelError: fp8 KV scales other than 1.0 (`geometry.check_kv_scales`).
        """
        layers = self._vllm_config.compilation_config.static_forward_context
        check_kv_scales(self.worker_side.deployment, layers)
        self.worker_side.register_kv_caches(kv_caches, layers)
        self._kv_caches = kv_caches

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """True (vLLM >= 0.33 asks before it enables `--enable-sleep-mode`): before vLLM's
        sleep discards the device KV cache, `unregister_kv_caches` waits for every transfer
        that touches it; `restore_kv_caches` checks it came back at the same addresses.
        Secondary tiers keep their chunks across the sleep; the host tier is cleared, since
        vLLM's sleep resets the prefix cache with `reset_connector=True` (`reset_cache`)."""
        return True

    def unregister_kv_caches(self) -> None:
        """Before sleep: drain every job reading or writing device KV (`WorkerSide`)."""
        self.worker_side.unregister_kv_caches(self._kv_caches)

    def restore_kv_caches(self) -> None:
        """After wake-up: check the KV tensors' addresses (`WorkerSide`).

        Raises:
            RuntimeError: a KV tensor moved during the sleep (names the layer).
        """
        self.worker_side.restore_kv_caches(self._kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Fence preempted blocks: wait for in-flight stores before vLLM reuses them."""
        self.worker_side.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Issue this step's loads (H2D)."""
        self.worker_side.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until the loads this layer reads have landed."""
        self.worker_side.wait_for_layer_load()

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Nothing per layer: one store per chunk moves every layer, after the forward."""

    def wait_for_save(self) -> None:
        """Issue this step's stores (D2H); they complete asynchronously."""
        self.worker_side.wait_for_save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """Delayed-free requests whose stores have all finished on this rank, and requests
        whose asynchronous loads have ended on it. A failed chunk is never reported as
        `failed_recving`: the scheduler side cuts the request back instead (vLLM's default
        `kv_load_failure_policy="fail"` would end it; `scheduler.loads` module docstring)."""
        sending, recving = self.worker_side.get_finished()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Device blocks whose load failed this step: vLLM recomputes them."""
        return self.worker_side.take_load_errors()

    def build_connector_worker_meta(self) -> KVHalWorkerMetadata | None:
        """Job completions of this rank since the last step."""
        return self.worker_side.take_worker_meta() if self.worker_side else None

    # -- scheduler side ----------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """Keep vLLM's KV cache manager (a request's block ids for stores)."""
        super().bind_kv_cache_manager(kv_cache_manager)
        self.scheduler_side.kv_cache_manager = kv_cache_manager
        self.scheduler_side.null_block_id = kv_cache_manager.block_pool.null_block.block_id

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Tokens loadable from kvhal beyond `num_computed_tokens`, and whether they load
        asynchronously (several KV cache groups, or chunks still to be promoted)."""
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        """Queue the load of the hit chunks into the blocks vLLM allocated."""
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVHalMetadata:
        """This step's loads, stores and fences for the workers."""
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        """Complete jobs that every rank has finished; settle finished asynchronous loads."""
        self.scheduler_side.update_connector_output(connector_output.kv_connector_worker_meta,
                                                    connector_output.finished_recving)

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Release the request; delay the free while a store reads its blocks."""
        return self.scheduler_side.request_finished(request)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """`request_finished` for vLLM's hybrid KV cache manager (every group at once)."""
        return self.scheduler_side.request_finished(request)

    def take_events(self) -> list:
        """kvhal's KV events as vLLM's `BlockStored`/`BlockRemoved` (`events.py`)."""
        return self.scheduler_side.take_events()

    def has_pending_push_work(self) -> bool:
        """Keep vLLM stepping while a job is in flight or events are untaken
        (`SchedulerSide.has_pending_push_work`); False on workers."""
        return self.scheduler_side is not None and self.scheduler_side.has_pending_push_work()

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int
                                       ) -> dict[CacheHitSource, int]:
        """The request's external hit tokens by the tier that served them: `host` (kvhal's
        host tier), `disk` (fs, obj), `p2p` (a peer), for `vllm:prompt_tokens_cached_by_source`."""
        if num_external_tokens == 0:
            return {}
        return {CacheHitSource(source): n for source, n in
                self.scheduler_side.hit_sources(request).items()}

    def get_kv_connector_stats(self) -> KVHalStats | None:
        """The engine's metrics since the last step (scheduler side; None on workers)."""
        if self.scheduler_side is None:
            return None
        data = self.scheduler_side.take_stats()
        return KVHalStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVHalStats:
        """Rebuild shipped stats in vLLM's logging process."""
        return KVHalStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVHalPromMetrics:
        """kvhal's `vllm:kv_offload_*` series on vLLM's `/metrics` (`stats.py`)."""
        return KVHalPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def reset_cache(self) -> bool:
        """Drop every chunk from kvhal's host tier (vLLM's `reset_prefix_cache(reset_connector=
        True)`); secondary tiers keep theirs. Published as `BlockRemoved` of those chunks."""
        self.scheduler_side.manager.clear()
        return True

    def shutdown(self) -> None:
        """Finish in-flight jobs and release the host region and tiers."""
        for side in (self.worker_side, self.scheduler_side):
            if side is not None:
                side.close()
