"""Geometry: validation names the field; exact page and chunk sizes, extra bytes included."""
from __future__ import annotations

import numpy as np
import pytest

from kvhal.layout import (ELEMENT_BYTES, Kind, KVCacheSpec, LayerGroup, LayoutError,
                          attention_spec, canonical_page_bytes, chunk_layout, mla_spec)

GOOD = dict(kind=Kind.FULL, num_layers=2, num_kv_heads=8, head_size=64, dtype="bf16",
            block_size=16)


@pytest.mark.parametrize("change,field", [
    ({"num_layers": 0}, "groups[0].num_layers"),
    ({"num_kv_heads": -1}, "groups[0].num_kv_heads"),
    ({"head_size": 0}, "groups[0].head_size"),
    ({"dtype": "int4"}, "groups[0].dtype"),
    ({"block_size": 2.5}, "groups[0].block_size"),
    ({"extra_bytes_per_token": -16}, "groups[0].extra_bytes_per_token"),
    ({"kind": Kind.SLIDING_WINDOW}, "groups[0].sliding_window"),
    ({"sliding_window": 128}, "groups[0].sliding_window"),
    ({"kind": Kind.MLA}, "groups[0].num_kv_heads"),
    ({"kind": Kind.MAMBA, "num_kv_heads": 1}, "groups[0].state_bytes"),
    ({"state_bytes": 64}, "groups[0].state_bytes"),
    ({"dtype": ["bf16"]}, "groups[0].dtype"),
    ({"num_layers": 2**40}, "groups[0].num_layers"),
    ({"num_kv_heads": 2**40}, "groups[0].num_kv_heads"),
    ({"num_kv_heads": 1, "block_size": 2**21}, "groups[0].block_size"),
    ({"head_size": 2**62}, "groups[0].head_size"),
    ({"extra_bytes_per_token": 2**30}, "groups[0].extra_bytes_per_token"),
    ({"kind": Kind.MAMBA, "num_kv_heads": 1, "head_size": 0, "state_bytes": 2**40},
     "groups[0].state_bytes"),
], ids=lambda v: str(v))
def test_impossible_group_is_refused_naming_the_field(change, field):
    with pytest.raises(LayoutError) as err:
        KVCacheSpec((LayerGroup(**{**GOOD, **change}),))
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}: ")


def test_second_group_error_names_its_index():
    with pytest.raises(LayoutError, match=r"^groups\[1\]\.dtype: unknown dtype 'fp4'"):
        KVCacheSpec((LayerGroup(**GOOD), LayerGroup(**{**GOOD, "dtype": "fp4"})))


def test_unknown_kind_string_is_refused():
    with pytest.raises(LayoutError, match="kind: unknown kind 'linear'"):
        LayerGroup(**{**GOOD, "kind": "linear"})


def test_element_bytes_table():
    assert {k: ELEMENT_BYTES[k] for k in ("bf16", "fp16", "fp32", "fp8", "fp8_e4m3",
                                          "fp8_e5m2")} == {
        "bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


def test_fp8_canonical_page_counts_scale_bytes():
    # 8 heads x 4 blocks x 16 tokens x (2 x 128 fp8 + 16 scale bytes)
    spec = attention_spec(num_layers=1, num_kv_heads=8, head_size=128, dtype="fp8",
                          block_size=16, extra_bytes_per_token=16)
    assert canonical_page_bytes(spec.groups[0], 4) == 8 * 4 * 16 * 272


def test_mla_and_mamba_page_bytes():
    mla = mla_spec(num_layers=1, latent_size=576, dtype="bf16", block_size=64).groups[0]
    mamba = LayerGroup(Kind.MAMBA, 1, 1, 0, "bf16", 16, state_bytes=1000)
    assert canonical_page_bytes(mla, 2) == 2 * 64 * 1152
    assert canonical_page_bytes(mamba, 3) == 1000   # the one state at the chunk's end


def test_chunk_layout_puts_layers_back_to_back_in_group_order():
    spec = KVCacheSpec((LayerGroup(**GOOD),
                        LayerGroup(Kind.MLA, 1, 1, 32, "fp16", 16)))
    chunk = chunk_layout(spec, 2)
    attn, mla = 8 * 32 * 256, 32 * 64
    assert chunk.page_offsets.tolist() == [0, attn, 2 * attn]
    assert chunk.page_bytes.tolist() == [attn, attn, mla]
    assert chunk.chunk_bytes == 2 * attn + mla


def test_chunk_layout_rejects_zero_blocks_per_chunk():
    with pytest.raises(LayoutError,
                       match=r"blocks_per_chunk: must be an int in \[1, 65536\], got 0"):
        chunk_layout(attention_spec(num_layers=1, num_kv_heads=1, head_size=1, dtype="bf16",
                                    block_size=1), 0)


def test_spec_is_hashable_and_equal_by_value():
    a = attention_spec(num_layers=2, num_kv_heads=8, head_size=64, dtype="bf16", block_size=16)
    b = KVCacheSpec([LayerGroup("full", 2, 8, 64, "bf16", 16)])
    assert a == b and hash(a) == hash(b)
    assert np.int64(a.num_layers) == 2


def test_spec_larger_than_a_tib_per_block_is_refused():
    with pytest.raises(LayoutError, match=r"^groups: one block of all layers is 2199023255552 "
                                          r"bytes, at most 1099511627776"):
        attention_spec(num_layers=2**15, num_kv_heads=2**10, head_size=2**8, dtype="fp16",
                       block_size=2**6)


def test_spec_groups_must_be_a_sequence():
    with pytest.raises(LayoutError, match="^groups: expected a sequence of LayerGroup, got None"):
        KVCacheSpec(None)


@pytest.mark.parametrize("blocks_per_chunk", [2**62, True, np.int64(0)])
def test_chunk_layout_refuses_out_of_range_blocks_per_chunk(blocks_per_chunk):
    spec = attention_spec(num_layers=1, num_kv_heads=1, head_size=1, dtype="bf16", block_size=1)
    with pytest.raises(LayoutError, match=r"^blocks_per_chunk: must be an int in \[1, 65536\]"):
        chunk_layout(spec, blocks_per_chunk)
