"""Strided layouts (`strided_layout`): pages read off a `[B, H, N, C]` view's byte strides, in
each of vLLM 0.33's six memory orders, with kernel blocks smaller than a vLLM block, at TP 1-4.

The oracle places logical KV with numpy `as_strided` from the stride order alone (the rule of
`vllm.v1.kv_cache_interface.compute_layout_strides`, written here from its docstring), never
from kvhal's offsets. Breaking `PageStrides.offsets` (head and token strides swapped) fails
every non-trivial case here.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kvhal.layout import (D2H, H2D, Kind, KVCacheSpec, LayerGroup, LayoutError, PageStrides,
                          chunk_mapper, device_cache, plan_copies, rank_share, strided_layout,
                          verify_tiling)

#: vLLM 0.33's `KVCacheLayout`: physical order of the logical axes [L, B, H, N, C].
ORDERS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
          "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}


class View:
    """A torch-like view of a numpy array (data_ptr, stride in elements, element_size)."""

    def __init__(self, array: np.ndarray):
        self.array, self.shape = array, array.shape

    def data_ptr(self) -> int:
        return self.array.__array_interface__["data"][0]

    def stride(self) -> tuple[int, ...]:
        return tuple(s // self.array.itemsize for s in self.array.strides)

    def element_size(self) -> int:
        return self.array.itemsize


def views(buf: np.ndarray, order: tuple, layers: int, kblocks: int, heads: int, ktokens: int,
          row: int) -> list[np.ndarray]:
    """One uint8 [B', H, N, row] view per layer of `buf`, dims laid out in `order`."""
    shape = (layers, kblocks, heads, ktokens, row)
    strides, step = [0] * 5, 1
    for dim in reversed(order):
        strides[dim] = step
        step *= shape[dim]
    full = np.lib.stride_tricks.as_strided(buf, shape, strides)
    return [full[i] for i in range(layers)]


def execute(plan) -> None:
    """Run a `CopyPlan` with memmove (addresses are raw host addresses here)."""
    for dst, dpitch, src, spitch, width, height in plan.copies_2d.tolist():
        for r in range(height):
            ctypes.memmove(dst + r * dpitch, src + r * spitch, width)
    for dst, src, n in zip(plan.dsts.tolist(), plan.srcs.tolist(), plan.sizes.tolist()):
        ctypes.memmove(dst, src, n)


def kv_spec(kind: Kind, heads: int, block: int) -> KVCacheSpec:
    head_size = 8 if kind is Kind.MLA else 4
    return KVCacheSpec((LayerGroup(kind, 2, 1 if kind is Kind.MLA else heads, head_size, "bf16",
                                   block),))


CASES = [(order, kind, tp, kt) for order in ORDERS for kind in (Kind.FULL, Kind.MLA)
         for tp in (1, 2, 4) for kt in (8, 4)
         if not (kt == 4 and order[0] != "L")]     # vLLM splits only layer-outer layouts


def chunk_case(kind: Kind, heads: int = 4, block: int = 8, nblocks: int = 6):
    """(spec, seeded logical KV at TP 1 as uint8 [layer][vLLM block][head][token][row], the
    chunk's vLLM blocks, its canonical bytes [layer][head][chunk token][row])."""
    spec = kv_spec(kind, heads, block)
    group = spec.groups[0]
    logical = np.random.default_rng(7).integers(
        0, 256, (2, nblocks, group.num_kv_heads, block, group.row_bytes), np.uint8)
    chunk_ids = np.array([4, 1])
    want = np.concatenate([np.concatenate(list(logical[layer, chunk_ids]), axis=1).ravel()
                           for layer in range(2)])
    return spec, logical, chunk_ids, want


@pytest.mark.parametrize("order,kind,tp,kt", CASES,
                         ids=lambda p: str(getattr(p, "value", p)))
def test_store_then_load_is_canonical_and_exact(order, kind, tp, kt):
    block, nblocks, per_chunk = 8, 6, 2
    spec, logical, chunk_ids, want = chunk_case(kind)
    group = spec.groups[0]
    row = group.row_bytes
    rng = np.random.default_rng(8)
    host = np.zeros(want.size, np.uint8)
    loaded = []
    for rank in range(tp):
        share = rank_share(group, tp, rank)
        buf = rng.integers(0, 256, 2 * nblocks * share.num_heads * block * row, np.uint8)
        ratio = block // kt
        layer_views = views(buf, ORDERS[order], 2, nblocks * ratio, share.num_heads, kt, row)
        for layer, v in enumerate(layer_views):
            mine = logical[layer][:, share.first_head:share.first_head + share.num_heads]
            # vLLM block b, token t -> kernel block b*ratio + t // kt, token t % kt
            v[:] = mine.reshape(nblocks, share.num_heads, ratio, kt, row).transpose(
                0, 2, 1, 3, 4).reshape(nblocks * ratio, share.num_heads, kt, row)
        sb = [s for s in layer_views[0].strides]
        layout = strided_layout(PageStrides(kt, sb[0] if ratio > 1 else 0, sb[1], sb[2]))
        verify_tiling(spec, layout, tp, per_chunk)
        mapper = chunk_mapper(spec, layout, tp, rank, per_chunk)
        device = device_cache(mapper, [View(v) for v in layer_views])
        assert device.num_blocks == nblocks
        execute(plan_copies(mapper, chunk_ids, device, host.ctypes.data, D2H))
        for v in layer_views:
            v[:] = 0
        execute(plan_copies(mapper, chunk_ids, device, host.ctypes.data, H2D))
        loaded.append((layer_views, share))
    np.testing.assert_array_equal(host, want)
    for layer_views, share in loaded:
        for layer, v in enumerate(layer_views):
            got = v.reshape(nblocks, ratio, share.num_heads, kt, row).transpose(0, 2, 1, 3, 4)
            got = got.reshape(nblocks, share.num_heads, block, row)
            mine = logical[layer][:, share.first_head:share.first_head + share.num_heads]
            np.testing.assert_array_equal(got[chunk_ids], mine[chunk_ids])
            assert not got[[0, 2, 3, 5]].any()   # blocks outside the chunk untouched (zeroed)


def test_packed_hnd_view_plans_the_same_bytes_as_the_named_layout():
    spec = kv_spec(Kind.FULL, 4, 8)
    row = spec.groups[0].row_bytes
    strided = chunk_mapper(spec, strided_layout(PageStrides(8, 0, 8 * row, row)), 2, 1, 2)
    named = chunk_mapper(spec, "packed-hnd", 2, 1, 2)
    assert strided.groups[0].runs == named.groups[0].runs


def test_view_that_disagrees_with_the_strides_is_refused_naming_the_layer():
    spec = kv_spec(Kind.FULL, 4, 8)
    row = spec.groups[0].row_bytes
    buf = np.zeros(2 * 6 * 4 * 8 * row, np.uint8)
    nhd = views(buf, ORDERS["LBNHC"], 2, 6, 4, 8, row)
    hnd = strided_layout(PageStrides(8, 0, 8 * row, row))
    mapper = chunk_mapper(spec, hnd, 1, 0, 1)
    with pytest.raises(LayoutError, match=r"tensors\[0\]: shape \(6, 4, 8, 16\)"):
        device_cache(mapper, [View(v) for v in nhd])


def test_overlapping_rows_are_refused():
    spec = kv_spec(Kind.FULL, 4, 8)
    with pytest.raises(LayoutError, match="overlap"):
        chunk_mapper(spec, strided_layout(PageStrides(8, 0, 4, 16)), 1, 0, 1)


def test_kernel_tokens_must_divide_the_block():
    spec = kv_spec(Kind.FULL, 4, 8)
    with pytest.raises(LayoutError, match="kernel blocks of 3 tokens do not divide"):
        chunk_mapper(spec, strided_layout(PageStrides(3, 1000, 16, 128)), 1, 0, 1)


@pytest.mark.parametrize("field,value", [("kernel_tokens", 0), ("head_stride", -1),
                                         ("token_stride", 1.5)])
def test_bad_strides_name_the_field(field, value):
    args = dict(kernel_tokens=8, kernel_stride=0, head_stride=128, token_stride=16)
    args[field] = value
    with pytest.raises(LayoutError, match=f"strides.{field}"):
        strided_layout(PageStrides(**args))


def test_numpy_strides_are_taken_as_python_ints():
    # np.int16 strides once overflowed in the page extent: wrong offsets, no error
    spec = kv_spec(Kind.FULL, 4, 8)
    row = spec.groups[0].row_bytes
    layout = strided_layout(PageStrides(np.int16(8), np.int16(0), np.int16(8 * row),
                                        np.int16(row)))
    assert layout == strided_layout(PageStrides(8, 0, 8 * row, row))
    assert chunk_mapper(spec, layout, 1, 0, 1).groups[0].plane_bytes == 4 * 8 * row


def test_equal_strides_make_equal_layouts_that_share_a_mapping():
    spec = kv_spec(Kind.FULL, 4, 8)
    a, b = (strided_layout(PageStrides(8, 0, 128, 16)) for _ in range(2))
    assert a == b and hash(a) == hash(b)
    assert chunk_mapper(spec, a, 1, 0, 1) is chunk_mapper(spec, b, 1, 0, 1)


def test_a_stride_beyond_any_memory_is_refused():
    with pytest.raises(LayoutError, match=r"strides.head_stride: must be an int in \[0, "):
        strided_layout(PageStrides(8, 0, 2**62, 16))
