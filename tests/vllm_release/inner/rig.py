"""vLLM's own engine-core pieces, minus the model, with kvhal on both connector roles.

`Rig` does what vLLM's `EngineCore` and one GPU worker do between them, with vLLM's own code
wherever it exists: the KV cache config from `get_global_kv_cache_groups` /
`get_kv_cache_configs` / `generate_scheduler_kv_cache_config` (the engine core's sequence),
vLLM's real `Scheduler` (which builds the SCHEDULER connector itself), the KV tensors from
`allocate_kv_cache` on the CPU read by FlashAttention (each layer's backend as kvhal sees it), and the worker's connector calls in the order of
`KVConnectorModelRunnerMixin._get_kv_connector_output` (loads before the forward only when
`SchedulerOutput.has_sync_kv_loads`). The one stand-in is the forward pass: it writes
`pattern(token, position, layer)` into the page row of every token it computes (an attention
layer's `[B, H, N, C]` row, all heads), and a state layer's page of the block where a step
ends holds `state_pattern(end, layer)`, so a reloaded block can be compared byte for byte.

Layer specs are built by hand from kvhal's tiny models' geometry (instantiating the model
needs vLLM's compiled ops): 4 attention layers, 2 KV heads of 64, bf16, 16-token blocks;
"swa" makes layers 0 and 2 slide over 32 tokens; "hybrid" makes layers 0 and 2 a state of
(3, 512) + (4, 64, 64) bf16 (35,840 bytes: Qwen3-Next's gated delta net at TP 1), in vLLM's
"align" cache mode, with 80-token blocks and the state page padded to the attention page
(40,960 bytes), as vLLM's hybrid model config sizes them (the smallest multiple of 16 tokens
whose attention page holds the state), so no attention page is padded.
"""
from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from vllm import SamplingParams
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,
                         SchedulerConfig, VllmConfig, set_current_vllm_config)
from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
from vllm.v1.core.kv_cache_utils import (generate_scheduler_kv_cache_config,
                                         get_request_block_hasher, init_none_hash,
                                         resolve_kv_cache_block_sizes)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.worker.utils import allocate_kv_cache

from kvhal.integrations.vllm.connector import KVHalConnector
from kvhal.integrations.harness.vllm.model import TINY, TINY_HYBRID, TINY_SWA, build_model

BLOCK = 16
HYBRID_BLOCK = 80
NUM_BLOCKS = 256
WINDOW = 32
STATE_SHAPES = ((3, 512), (4, 64, 64))
MODELS = {"full": TINY, "swa": TINY_SWA, "hybrid": TINY_HYBRID}


def pattern(token: int, position: int, layer: int) -> int:
    """The byte the stand-in forward writes for `token` at `position` in `layer`."""
    return (token * 7 + position * 3 + layer * 29) % 251


def state_pattern(end: int, layer: int) -> int:
    """The byte of a state layer's page after a step that ended at token `end`."""
    return (end * 5 + layer * 17 + 1) % 253


@dataclass
class AttentionLayer:
    """What kvhal reads of one of vLLM's attention layers (`static_forward_context`): the
    attention backend (class) that reads its KV view."""

    attn_backend: Any


def layer_specs(kind: str) -> dict[str, Any]:
    """vLLM KV cache specs of the 4 layers of model `kind` ("full", "swa", "hybrid")."""
    block = HYBRID_BLOCK if kind == "hybrid" else BLOCK
    attn = dict(block_size=block, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    specs: dict[str, Any] = {}
    for i in range(4):
        name = f"model.layers.{i}.attn"
        if kind == "swa" and i % 2 == 0:
            specs[name] = SlidingWindowSpec(**attn, sliding_window=WINDOW)
        elif kind == "hybrid" and i % 2 == 0:
            specs[name] = MambaSpec(block_size=block, shapes=STATE_SHAPES,
                                    dtypes=(torch.bfloat16,) * 2, mamba_cache_mode="align",
                                    page_size_padded=block * 2 * 128 * 2)
        else:
            specs[name] = FullAttentionSpec(**attn)
    return specs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_tp_ready = False


def _init_tp(vllm_config: VllmConfig) -> None:
    """A TP world of one (gloo), as a worker process has: the WORKER connector reads its rank."""
    global _tp_ready
    if not _tp_ready:
        with set_current_vllm_config(vllm_config):
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
            ensure_model_parallel_initialized(1, 1)
        _tp_ready = True


class Rig:
    """One engine: vLLM's `Scheduler` with kvhal's SCHEDULER connector, and one worker's
    kvhal WORKER connector over `allocate_kv_cache` tensors (module docstring).

    Args:
        kind: "full", "swa" or "hybrid" (`layer_specs`).
        extra_config: kvhal's config (`kv_connector_extra_config`).
        layout: vLLM's `KVCacheLayout` name for the tensors (None: vLLM resolves it from the
            default preference).
        register: False leaves `register_kv_caches` for the test to call.
    """

    def __init__(self, kind: str, extra_config: dict, layout: str | None = "LBHNC",
                 register: bool = True):
        model = ModelConfig(model=str(build_model(MODELS[kind])), skip_tokenizer_init=True,
                            dtype="bfloat16", seed=0, max_model_len=2048)
        self.block_size = HYBRID_BLOCK if kind == "hybrid" else BLOCK
        self.vllm_config = VllmConfig(
            model_config=model, device_config=DeviceConfig("cpu"),
            scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512,
                                             max_model_len=2048, is_encoder_decoder=False),
            cache_config=CacheConfig(block_size=HYBRID_BLOCK if kind == "hybrid" else BLOCK, enable_prefix_caching=True,
                                     mamba_cache_mode="align" if kind == "hybrid" else "none"),
            kv_transfer_config=KVTransferConfig(
                kv_connector="KVHalConnector", kv_role="kv_both",
                kv_connector_module_path="kvhal.integrations.vllm.connector",
                kv_connector_extra_config=extra_config))
        vc = self.vllm_config
        self.specs = layer_specs(kind)
        if layout is not None:
            vc.cache_config.kv_cache_layout = layout
        resolve_kv_cache_layout(vc, [["LBNHC", "LBHNC"]], self.specs.values())
        groups = get_global_kv_cache_groups(vc, [self.specs])
        page = max(s.page_size_bytes for s in self.specs.values())
        worker_cfg, = get_kv_cache_configs(vc, [self.specs], [NUM_BLOCKS * 4 * page], groups)
        worker_cfg.kv_cache_layout = vc.cache_config.kv_cache_layout
        sched_cfg = generate_scheduler_kv_cache_config([worker_cfg])
        vc.cache_config.num_gpu_blocks = sched_cfg.num_blocks
        block_size, hash_block = resolve_kv_cache_block_sizes(sched_cfg, vc)
        for cfg in (worker_cfg, sched_cfg):
            cfg.hash_block_size = hash_block
        self.kv_cache_config = worker_cfg
        self.scheduler = Scheduler(vllm_config=vc, kv_cache_config=sched_cfg,
                                   structured_output_manager=StructuredOutputManager(vc),
                                   block_size=block_size, hash_block_size=hash_block,
                                   log_stats=True)
        self.connector: KVHalConnector = self.scheduler.connector
        _init_tp(vc)
        vc.compilation_config.static_forward_context = {
            name: AttentionLayer(FlashAttentionBackend) for name, spec in self.specs.items()
            if not isinstance(spec, MambaSpec)}
        self.worker = KVHalConnector(vc, KVConnectorRole.WORKER, worker_cfg)
        self.kv_caches = allocate_kv_cache(worker_cfg, torch.device("cpu"),
                                           vc.cache_config.get_resolved_kv_cache_layout())
        self.group_of = {name: gi for gi, g in enumerate(worker_cfg.kv_cache_groups)
                         for name in g.layer_names}
        self.layer_index = {name: i for i, name in enumerate(self.specs)}
        self._hasher = get_request_block_hasher(hash_block, sha256)
        init_none_hash(sha256)
        self.requests: dict[str, Request] = {}
        self.stats: list[Any] = []   # SchedulerStats of every step
        self.worker_steps: list[dict] = []
        self.blocks: dict[str, tuple[list[int], ...]] = {}   # block ids a forward wrote into
        if register:
            self.worker.register_kv_caches(self.kv_caches)

    # -- requests ----------------------------------------------------------------------------
    def add(self, name: str, tokens: list[int]) -> Request:
        """Queue a request of prompt `tokens` that generates one token."""
        params = SamplingParams(max_tokens=1)
        params.update_from_generation_config({}, 2)
        request = Request(request_id=name, prompt_token_ids=list(tokens),
                          sampling_params=params, pooling_params=None,
                          block_hasher=self._hasher)
        self.requests[name] = request
        self.scheduler.add_request(request)
        return request

    def run(self, timeout_s: float = 120.0, after_save: Callable[[Any], None] | None = None,
            after_load: Callable[[Any], None] | None = None) -> None:
        """Step until the scheduler has no request left (and no delayed free), as an engine
        does: steps that schedule nothing (waiting on kvhal's transfers) go on, 1 ms apart.
        A loaded machine runs the transfers' threads late, so a bound on steps (200 once
        ran out under a parallel test run) would fail correct code: the bound is time.

        Raises:
            AssertionError: requests left after `timeout_s` seconds (names how many steps).
        """
        deadline, steps = time.monotonic() + timeout_s, 0
        while self.scheduler.has_requests():
            if time.monotonic() > deadline:
                raise AssertionError(f"not done after {timeout_s} s ({steps} steps)")
            if not self.step(after_save, after_load):
                time.sleep(0.001)
            steps += 1

    # -- one engine step ---------------------------------------------------------------------
    def step(self, after_save: Callable[[Any], None] | None = None,
             after_load: Callable[[Any], None] | None = None) -> int:
        """One `schedule` → worker step → `update_from_output`; `after_save(metadata)` runs
        right after `wait_for_save` issued the stores of the step's `KVHalMetadata`, and
        `after_load(metadata)` right after `start_load_kv` issued a step's synchronous loads
        (before the forward waits for them). Returns the tokens the step scheduled."""
        out = self.scheduler.schedule()
        worker, meta = self.worker, out.kv_connector_metadata
        worker.bind_connector_metadata(meta)
        if out.has_sync_kv_loads:
            worker.start_load_kv(None)
            if after_load is not None:
                after_load(meta)
        for name in self.specs:
            worker.wait_for_layer_load(name)
        self._forward(out)
        if not out.has_sync_kv_loads:
            worker.start_load_kv(None)
        worker.wait_for_save()
        if after_save is not None:
            after_save(meta)
        results = worker.get_transfer_results(out.finished_req_ids)
        connector_output = KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            invalid_block_ids=worker.get_block_ids_with_load_errors(),
            kv_connector_stats=worker.get_kv_connector_stats(),
            kv_connector_worker_meta=worker.build_connector_worker_meta())
        worker.clear_connector_metadata()
        self.worker_steps.append({"sync_loads": out.has_sync_kv_loads,
                                  "recving": set(results.finished_recving)})
        req_ids = list(out.num_scheduled_tokens)
        runner_output = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[5] for _ in req_ids], kv_connector_output=connector_output)
        engine_outputs = self.scheduler.update_from_output(out, runner_output)
        for eco in engine_outputs.values():
            if eco.scheduler_stats is not None:
                self.stats.append(eco.scheduler_stats)
        return out.total_num_scheduled_tokens

    def _forward(self, out: Any) -> None:
        """The stand-in forward pass (module docstring) of every scheduled request."""
        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, n in out.num_scheduled_tokens.items():
            request = self.requests[req_id]
            start = starts[req_id]
            blocks = self.blocks[req_id] = self.block_ids(req_id)
            for name, tensor in self.kv_caches.items():
                layer, group = self.layer_index[name], self.group_of[name]
                pages = tensor.view(torch.uint8) if tensor.dim() > 1 else tensor
                if isinstance(self.specs[name], MambaSpec):
                    block = blocks[group][(start + n - 1) // self.block_size]
                    self.state_page(name, block)[:] = state_pattern(start + n, layer)
                    continue
                for p in range(start, min(start + n, request.num_prompt_tokens)):
                    tok = request.all_token_ids[p]
                    row = blocks[group][p // self.block_size], p % self.block_size
                    pages[row[0], :, row[1], :] = pattern(tok, p, layer)

    # -- inspection --------------------------------------------------------------------------
    def block_ids(self, req_id: str) -> tuple[list[int], ...]:
        """The request's block ids per KV cache group (what the worker's block table holds)."""
        return self.scheduler.kv_cache_manager.get_block_ids(req_id)

    def state_page(self, layer: str, block: int) -> torch.Tensor:
        """A state layer's real state bytes (uint8) in `block`."""
        tensor = self.kv_caches[layer]
        nbytes = self.specs[layer].real_page_size_bytes
        return tensor.view(torch.uint8).reshape(tensor.shape[0], -1)[block, :nbytes]

    def attention_row(self, layer: str, block: int, offset: int) -> torch.Tensor:
        """An attention layer's `[H, C]` bytes of token `offset` of `block`."""
        return self.kv_caches[layer].view(torch.uint8)[block, :, offset, :]

    def close(self) -> None:
        """Shut both connector roles down."""
        self.worker.shutdown()
        self.connector.shutdown()


def prompt(seed: int, num_tokens: int) -> list[int]:
    """A seeded random prompt of `num_tokens` ids in [3, 1024)."""
    return np.random.default_rng(seed).integers(3, 1024, num_tokens).tolist()

