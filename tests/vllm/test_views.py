"""vLLM >= 0.33 KV views → kvhal layouts (`integrations/vllm/views.py`): what is refused and why.

The mapping of every backend and layout built by vLLM 0.33's own allocation code is proven in
`tests/vllm_release/inner/test_gpu_layouts.py`; these are the refusals and the name resolution,
on plain torch views shaped as `create_kv_cache_views` shapes them.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvhal.integrations.vllm.geometry import UnsupportedModelError, group_spec
from kvhal.integrations.vllm.views import resolved_layout, view_layout
from kvhal.layout import DeviceLayout


def view(order: str, blocks=6, heads=4, tokens=16, cell=128) -> torch.Tensor:
    """A bf16 [B, H, N, C] view whose memory order is `order` over "BHNC"."""
    sizes = dict(B=blocks, H=heads, N=tokens, C=cell)
    dense = torch.zeros([sizes[d] for d in order], dtype=torch.bfloat16)
    return dense.permute(*[order.index(d) for d in "BHNC"])


def test_flash_attention_lhbnc_maps_heads_a_layer_apart():
    layout = view_layout("l0", view("HBNC"), "LHBNC", "FLASH_ATTN", 16, 256)
    assert isinstance(layout, DeviceLayout)
    # bytes: head stride = 6 blocks x 16 tokens x 256 B, token stride = one 256 B cell
    assert (layout.strides.head_stride, layout.strides.token_stride) == (6 * 16 * 256, 256)


def test_kernel_blocks_half_the_block():
    layout = view_layout("l0", view("BHNC", blocks=12, tokens=16), "LBHNC", "FLASH_ATTN", 32, 256)
    assert layout.strides.kernel_tokens == 16
    assert layout.strides.kernel_stride == 4 * 16 * 256


def test_cpu_backend_keeps_its_tiles():
    assert view_layout("l0", view("BHNC"), "LBHNC", "CPU_ATTN", 16, 256) == "vllm-cpu"


def test_strides_that_contradict_vllms_layout_are_refused_naming_layer_backend_and_shape():
    with pytest.raises(UnsupportedModelError,
                       match=r"layer l3 \(FLASHINFER, vLLM layout LBHNC\): KV view of shape "
                             r"\(6, 4, 16, 128\).*do not order blocks, heads and tokens"):
        view_layout("l3", view("BNHC"), "LBHNC", "FLASHINFER", 16, 256)


def test_an_unmapped_backend_is_refused_by_name():
    with pytest.raises(UnsupportedModelError, match=r"\(TURBOQUANT,.*has not mapped how this "
                                                    r"backend reads its KV page"):
        view_layout("l0", view("BHNC"), "LBHNC", "TURBOQUANT", 16, 256)


def test_aiter_shuffled_tiles_are_refused(monkeypatch):
    monkeypatch.setenv("VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT", "1")
    with pytest.raises(UnsupportedModelError, match="shuffles each K and V tile"):
        view_layout("l0", view("BHNC"), "LBHNC", "ROCM_AITER_UNIFIED_ATTN", 16, 256)


def test_kernel_tokens_that_do_not_divide_the_block_are_refused():
    with pytest.raises(UnsupportedModelError, match="kernel blocks of 24 tokens"):
        view_layout("l0", view("BHNC", tokens=24), "LBHNC", "FLASH_ATTN", 32, 256)


def test_cpu_backend_outside_lbhnc_is_refused():
    with pytest.raises(UnsupportedModelError, match="CPU_ATTN keeps K rows then V rows"):
        view_layout("l0", view("BNHC"), "LBNHC", "CPU_ATTN", 16, 256)


@pytest.mark.parametrize("name,want", [("HND", "LBHNC"), ("NHD", "LBNHC"), ("BHLNC", "BHLNC"),
                                       (None, None)])
def test_resolved_layout_from_the_kv_cache_config(name, want):
    assert resolved_layout(SimpleNamespace(kv_cache_layout=name), None) == want


def test_an_unknown_vllm_layout_is_refused():
    with pytest.raises(UnsupportedModelError, match="kv_cache_layout 'LNBHC'"):
        resolved_layout(SimpleNamespace(kv_cache_layout="LNBHC"), None)


def test_a_page_the_backend_packs_its_own_way_is_refused():
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    spec = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype=torch.bfloat16)
    object.__setattr__(spec, "num_head_slots", 2)    # vLLM 0.33: AITER FA's shuffled K/V slots
    group = SimpleNamespace(kv_cache_spec=spec, layer_names=["model.layers.0.attn"])
    model = SimpleNamespace(get_total_num_kv_heads=lambda: 4)
    with pytest.raises(UnsupportedModelError,
                       match=r"kv_cache_groups\[0\] \(layer model.layers.0.attn.*num_head_slots=2"):
        group_spec(0, group, model)


def test_a_cell_that_is_not_the_groups_row_is_refused_by_size():
    with pytest.raises(UnsupportedModelError, match="cells of 128 bytes, the group's K ‖ V "
                                                    "rows have 256"):
        view_layout("l0", view("BHNC", cell=64), "LBHNC", "FLASH_ATTN", 16, 256)


def test_a_group_whose_layers_read_their_views_differently_is_refused():
    from kvhal.integrations.vllm.geometry import Deployment, GroupInfo
    from kvhal.integrations.vllm.worker import WorkerSide
    from kvhal.layout import attention_spec, chunk_layout
    spec = attention_spec(num_layers=2, num_kv_heads=4, head_size=64, dtype="bf16",
                          block_size=16)
    names = ("l0", "l1")
    group = GroupInfo(0, spec, names, chunk_layout(spec, 1).chunk_bytes)
    dep = Deployment((group,), 16, 1, 1, "bfloat16", "sha256", "0", "LBHNC")
    backends = {"l0": "FLASH_ATTN", "l1": "CPU_ATTN"}   # rows vs K-rows-then-V-rows tiles
    layers = {n: SimpleNamespace(attn_backend=SimpleNamespace(get_name=lambda b=b: b))
              for n, b in backends.items()}
    side = WorkerSide(dep, 0)
    with pytest.raises(UnsupportedModelError, match=r"layer l1 \(CPU_ATTN\) lays out its KV "
                                                    r"otherwise than layer l0 \(FLASH_ATTN\)"):
        side.register_kv_caches({n: view("BHNC") for n in names}, layers)
    side.close()


def _config(layers: dict) -> SimpleNamespace:
    """The parts of vLLM's `VllmConfig` `geometry.deployment` reads, with the worker's
    attention layers (`compilation_config.static_forward_context`)."""
    return SimpleNamespace(
        model_config=SimpleNamespace(get_total_num_kv_heads=lambda: 4),
        cache_config=SimpleNamespace(cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        compilation_config=SimpleNamespace(static_forward_context=layers))


def test_a_group_refusal_names_the_layer_the_backend_and_the_shape():
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, KVCacheGroupSpec

    from kvhal.integrations.vllm.geometry import deployment
    spec = ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=4, head_size=64,
                                     dtype=torch.bfloat16, attention_chunk_size=256)
    groups = [KVCacheGroupSpec(["model.layers.0.attn"], spec)]
    layers = {"model.layers.0.attn": SimpleNamespace(
        attn_backend=SimpleNamespace(get_name=lambda: "FLASH_ATTN"))}
    with pytest.raises(UnsupportedModelError) as err:
        deployment(_config(layers), SimpleNamespace(kv_cache_groups=groups), 1)
    assert str(err.value).startswith(
        "kv_cache_groups[0] (layer model.layers.0.attn, ChunkedLocalAttentionSpec, backend "
        "FLASH_ATTN, page [H, N, C] = [4, 16, 128] bfloat16): ChunkedLocalAttentionSpec is "
        "not supported")


def test_a_state_group_refusal_names_the_backend_vllms_state_layer_reports():
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MambaSpec

    from kvhal.integrations.vllm.geometry import deployment
    spec = MambaSpec(block_size=16, shapes=((3, 512), (4, 64, 64)),
                     dtypes=(torch.bfloat16, torch.bfloat16), mamba_cache_mode="none")
    groups = [KVCacheGroupSpec(["model.layers.0.mixer"], spec)]
    mixer = SimpleNamespace(get_attn_backend=lambda: SimpleNamespace(get_name=lambda: "GDN_ATTN"))
    with pytest.raises(UnsupportedModelError) as err:
        deployment(_config({"model.layers.0.mixer": mixer}),
                   SimpleNamespace(kv_cache_groups=groups), 1)
    assert str(err.value).startswith(
        "kv_cache_groups[0] (layer model.layers.0.mixer, MambaSpec, backend GDN_ATTN, state "
        "(3, 512) bfloat16, (4, 64, 64) bfloat16): mamba_cache_mode 'none'")


@pytest.mark.parametrize("make,want", [
    (lambda s: s.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, head_size_v=32,
                                   dtype=torch.float16),
     "page [H, N, C] = [2, 16, 96] float16"),
    (lambda s: s.MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576,
                                  dtype=torch.bfloat16),
     "page [H, N, C] = [1, 64, 576] bfloat16"),
], ids=["k-and-v-of-two-sizes", "mla-latent"])
def test_page_shape_is_the_views_h_n_c(make, want):
    import vllm.v1.kv_cache_interface as specs

    from kvhal.integrations.vllm.geometry import page_shape
    assert page_shape(make(specs)) == want
