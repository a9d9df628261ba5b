"""Copy runs: exact coalesced runs, writer election, refusals naming the layer."""
from __future__ import annotations

import pytest

from kvhal import plugins
from kvhal.layout import (BUILTIN_LAYOUTS, CopyRun, Kind, KVCacheSpec, LayerGroup, LayoutError,
                          attention_spec, chunk_mapper, get_layout, map_group, mla_spec,
                          verify_tiling)

LLAMA_8B = attention_spec(num_layers=32, num_kv_heads=8, head_size=128, dtype="bf16",
                          block_size=16)


def runs(spec, layout, tp, rank=0, n=1):
    return map_group(spec, 0, layout, tp, rank, n).runs


def test_builtin_layouts_are_registered_through_the_entry_point():
    assert list(plugins.layouts()) == [lay.name for lay in BUILTIN_LAYOUTS]


def test_unknown_layout_lists_registered_ones():
    with pytest.raises(LayoutError, match="unknown layout 'flash'; registered: packed-hnd, "):
        get_layout("flash")


def test_packed_hnd_is_one_contiguous_run_per_rank():
    # rank 1 of 2 holds heads 4..7: 4 heads x 16 tokens x 512 B, at canonical head 4
    assert runs(LLAMA_8B, "packed-hnd", 2, rank=1) == (
        CopyRun(0, 32768, 32768, 1, 32768, 32768),)


def test_packed_hnd_chunk_of_16_blocks_is_one_strided_run_per_block():
    # each head's 16 tokens land 256 chunk tokens apart in the canonical page
    assert runs(LLAMA_8B, "packed-hnd", 1, n=16) == (CopyRun(0, 0, 8192, 8, 8192, 131072),)


def test_vllm_cpu_layout_is_two_strided_runs_per_head():
    got = runs(LLAMA_8B, "vllm-cpu", 8, rank=3)
    # head 3: K rows then V rows, each 16 x 256 B, canonical row 512 B
    assert got == (CopyRun(0, 3 * 8192, 256, 16, 256, 512),
                   CopyRun(4096, 3 * 8192 + 256, 256, 16, 256, 512))


@pytest.mark.parametrize("layout,per_head,fixed", [
    ("packed-hnd", 0, 1), ("packed-nhd", 1, 0), ("split-nhd", 2, 0), ("split-hnd", 0, 2),
    ("separate-kv", 2, 0), ("vllm-cpu", 2, 0)])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_llama_runs_per_rank(layout, per_head, fixed, tp):
    heads = 8 // tp
    expected = 1 if (layout == "packed-nhd" and heads == 1) else per_head * heads + fixed
    assert len(runs(LLAMA_8B, layout, tp)) == expected


def test_gqa_replicas_elect_the_lowest_rank():
    spec = attention_spec(num_layers=1, num_kv_heads=2, head_size=4, dtype="bf16",
                          block_size=4)
    shares = [map_group(spec, 0, "packed-hnd", 8, r, 1).share for r in range(8)]
    assert [s.first_head for s in shares] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [s.writer for s in shares] == [True, False, False, False, True, False, False, False]
    assert all(s.replicas == 4 for s in shares)
    assert map_group(spec, 0, "packed-hnd", 8, 5, 1).store_runs == ()
    assert map_group(spec, 0, "packed-hnd", 8, 5, 1).runs == runs(spec, "packed-hnd", 8, 4)


def test_mla_is_replicated_and_rank_0_writes():
    spec = mla_spec(num_layers=1, latent_size=8, dtype="bf16", block_size=4)
    m0, m3 = (map_group(spec, 0, "mla", 4, r, 2) for r in (0, 3))
    assert (m0.share.writer, m3.share.writer) == (True, False)
    assert m0.runs == m3.runs == (CopyRun(0, 0, 64, 1, 64, 64),)
    assert m3.store_runs == ()


@pytest.mark.parametrize("heads,tp,reason", [
    (6, 4, "6 KV heads do not split evenly over tp_size 4"),
    (3, 8, "tp_size 8 is not a multiple of the 3 KV heads"),
])
def test_uneven_head_split_is_refused_naming_the_layers(heads, tp, reason):
    spec = KVCacheSpec((LayerGroup(Kind.FULL, 4, 8, 4, "bf16", 4),
                        LayerGroup(Kind.FULL, 2, heads, 4, "bf16", 4)))
    with pytest.raises(LayoutError) as err:
        verify_tiling(spec, "packed-hnd", tp, 1)
    assert str(err.value).startswith(f"groups[1] (layers 4-5, full): {reason}")
    assert err.value.layer == 4


def test_split_layout_refuses_fp8_scales():
    spec = attention_spec(num_layers=1, num_kv_heads=8, head_size=16, dtype="fp8",
                          block_size=4, extra_bytes_per_token=16)
    with pytest.raises(LayoutError, match=r"layers 0-0, full\): layout 'split-hnd' has no "
                                          "place for 16 extra bytes per token"):
        map_group(spec, 0, "split-hnd", 1, 0, 1)


def test_mamba_is_refused_above_tp_1():
    spec = KVCacheSpec((LayerGroup(Kind.MAMBA, 1, 1, 0, "bf16", 16, state_bytes=64),))
    assert runs(spec, "mamba", 1) == (CopyRun(0, 0, 64, 1, 64, 64),)
    with pytest.raises(LayoutError, match="mamba state is opaque"):
        map_group(spec, 0, "mamba", 2, 0, 1)


def test_bad_tp_rank_names_the_field():
    with pytest.raises(LayoutError, match=r"tp_rank: must be in \[0, 2\), got 2"):
        map_group(LLAMA_8B, 0, "packed-hnd", 2, 2, 1)


@pytest.mark.parametrize("tp", [0, -1, "2", 2.0, True, 2048])
def test_verify_tiling_refuses_a_bad_tp_size(tp):
    with pytest.raises(LayoutError, match=r"^tp_size: must be an int in \[1, 1024\], got "):
        verify_tiling(LLAMA_8B, "packed-hnd", tp, 1)


@pytest.mark.parametrize("gi", [1, -1])
def test_group_index_out_of_range_is_refused(gi):
    with pytest.raises(LayoutError, match=rf"^group_index: must be in \[0, 1\), got {gi}"):
        map_group(LLAMA_8B, gi, "packed-hnd", 1, 0, 1)


def test_layout_names_may_be_a_list():
    spec = KVCacheSpec((LayerGroup(Kind.FULL, 1, 8, 4, "bf16", 4),
                        LayerGroup(Kind.MLA, 1, 1, 8, "bf16", 4)))
    mapper = chunk_mapper(spec, ["split-nhd", "mla"], 2, 1, 1)
    assert mapper.layouts == ("split-nhd", "mla")
    assert mapper is chunk_mapper(spec, ("split-nhd", "mla"), 2, 1, 1)
    with pytest.raises(LayoutError, match=r"^layout: names must be strings or DeviceLayouts, got \(None,"):
        chunk_mapper(spec, [None, "mla"], 2, 1, 1)
