"""plan_copies / plan_job_copies: exact addresses, writer-only stores, replica loads, prefixes,
bad input."""
from __future__ import annotations

import numpy as np
import pytest

from kvhal.layout import (D2H, H2D, DeviceCache, LayoutError, attention_spec,
                          chunk_mapper, device_cache, plan_copies, plan_job_copies)
from kvhal.layout.plan import merge_plans

TINY = attention_spec(num_layers=1, num_kv_heads=2, head_size=1, dtype="bf16", block_size=2)


def cache(bases, block_stride, plane_stride=0, num_blocks=8):
    n = len(bases)
    return DeviceCache(np.array(bases, np.uint64), np.full(n, block_stride, np.int64),
                       np.full(n, plane_stride, np.int64), num_blocks)


class NumpyTensor:
    """A torch-like view of a numpy array: data_ptr, stride (elements), element_size, shape."""

    def __init__(self, array: np.ndarray):
        self.array, self.shape = array, array.shape

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def stride(self) -> tuple[int, ...]:
        return tuple(s // self.array.itemsize for s in self.array.strides)

    def element_size(self) -> int:
        return self.array.itemsize


def test_strided_run_becomes_one_2d_copy_per_block():
    # 2 heads x 2 tokens x 4 B rows; chunk of 2 blocks: head rows 16 B apart in the chunk page
    mapper = chunk_mapper(TINY, "packed-hnd", 1, 0, 2)
    plan = plan_copies(mapper, np.array([5, 2]), cache([1000], 16), 5000, D2H)
    assert plan.copies_2d.dtype == np.uint64
    assert plan.copies_2d.tolist() == [[5000, 16, 1080, 8, 8, 2], [5008, 16, 1032, 8, 8, 2]]
    load = plan_copies(mapper, np.array([5, 2]), cache([1000], 16), 5000, H2D)
    assert load.copies_2d.tolist() == [[1080, 8, 5000, 16, 8, 2], [1032, 8, 5008, 16, 8, 2]]
    assert plan.sizes.size == 0 and plan.nbytes == 32


def test_contiguous_runs_become_one_batch():
    spec = attention_spec(num_layers=2, num_kv_heads=2, head_size=1, dtype="bf16",
                          block_size=2)
    mapper = chunk_mapper(spec, "packed-hnd", 2, 1, 1)
    plan = plan_copies(mapper, np.array([3]), cache([1000, 9000], 8), 5000, H2D)
    assert plan.copies_2d.shape == (0, 6)
    assert plan.dsts.tolist() == [1024, 9024]
    assert plan.srcs.tolist() == [5008, 5024]
    assert plan.sizes.tolist() == [8, 8]
    assert plan.dsts.dtype == plan.srcs.dtype == plan.sizes.dtype == np.uint64


def test_separate_kv_addresses_each_plane():
    spec = attention_spec(num_layers=1, num_kv_heads=1, head_size=1, dtype="bf16",
                          block_size=1)
    mapper = chunk_mapper(spec, "separate-kv", 1, 0, 1)
    plan = plan_copies(mapper, np.array([3]), cache([1000], 2, plane_stride=100), 5000, D2H)
    assert sorted(zip(plan.srcs.tolist(), plan.dsts.tolist(), plan.sizes.tolist())) == [
        (1006, 5000, 2), (1106, 5002, 2)]


def test_store_skips_replicas_but_load_fills_them():
    mqa = attention_spec(num_layers=1, num_kv_heads=1, head_size=1, dtype="bf16", block_size=2)
    mapper = chunk_mapper(mqa, "packed-hnd", 2, 1, 1)
    assert plan_copies(mapper, np.array([0]), cache([1000], 8), 5000, D2H).nbytes == 0
    assert plan_copies(mapper, np.array([0]), cache([1000], 8), 5000, H2D).nbytes == 8


def test_prefix_of_a_chunk_plans_only_its_blocks():
    mapper = chunk_mapper(TINY, "packed-hnd", 1, 0, 2)
    plan = plan_copies(mapper, np.array([5]), cache([1000], 16), 5000, D2H)
    assert plan.copies_2d.tolist() == [[5000, 16, 1080, 8, 8, 2]]


@pytest.mark.parametrize("ids,message", [
    (np.array([8]), r"block_ids: ids must be in \[0, 8\), got 8..8"),
    (np.array([-1]), r"block_ids: ids must be in \[0, 8\), got -1..-1"),
    (np.array([1.0]), "block_ids: must be a 1-D integer array, got float64"),
    (np.array([1, 2, 3]), "block_ids: 3 blocks, must be 1..2"),
    (np.array([], np.int64), "block_ids: 0 blocks, must be 1..2"),
])
def test_bad_block_ids_are_refused(ids, message):
    mapper = chunk_mapper(TINY, "packed-hnd", 1, 0, 2)
    with pytest.raises(LayoutError, match=message):
        plan_copies(mapper, ids, cache([1000], 16), 5000, D2H)


def test_bad_direction_is_refused():
    mapper = chunk_mapper(TINY, "packed-hnd", 1, 0, 1)
    with pytest.raises(LayoutError, match="direction: must be 'd2h' or 'h2d', got 'up'"):
        plan_copies(mapper, np.array([0]), cache([1000], 16), 5000, "up")


def test_device_cache_reads_tensor_pointers_and_strides():
    spec = attention_spec(num_layers=2, num_kv_heads=2, head_size=4, dtype="fp16",
                          block_size=2)
    mapper = chunk_mapper(spec, "separate-kv", 1, 0, 1)
    tensors = [NumpyTensor(np.zeros((2, 5, 2, 2, 4), np.float16)) for _ in range(2)]
    dev = device_cache(mapper, tensors)
    assert dev.bases.tolist() == [t.data_ptr() for t in tensors]
    assert dev.block_strides.tolist() == [32, 32]
    assert dev.plane_strides.tolist() == [160, 160]
    assert dev.num_blocks == 5


def test_device_cache_refuses_a_tensor_of_the_wrong_size():
    mapper = chunk_mapper(TINY, "packed-hnd", 1, 0, 1)
    with pytest.raises(LayoutError, match=r"tensors\[0\]: shape \(4, 2, 2, 3\)"):
        device_cache(mapper, [NumpyTensor(np.zeros((4, 2, 2, 3), np.float16))])


def test_expanded_runs_move_the_same_bytes_as_2d_copies():
    mapper = chunk_mapper(TINY, "packed-hnd", 1, 0, 2)
    plan = plan_copies(mapper, np.array([5, 2]), cache([1000], 16), 5000, D2H, expand_up_to=2)
    assert plan.copies_2d.shape == (0, 6)
    assert list(zip(plan.dsts.tolist(), plan.srcs.tolist(), plan.sizes.tolist())) == [
        (5000, 1080, 8), (5016, 1088, 8), (5008, 1032, 8), (5024, 1040, 8)]


def test_expand_up_to_must_be_positive():
    mapper = chunk_mapper(TINY, "packed-hnd", 1, 0, 1)
    with pytest.raises(LayoutError, match="expand_up_to: must be an int >= 1, got 0"):
        plan_copies(mapper, np.array([0]), cache([1000], 16), 5000, D2H, expand_up_to=0)


def test_repeated_block_ids_are_refused():
    # a load of [3, 3] would write chunk blocks 0 and 1 into the same device bytes, unordered
    mapper = chunk_mapper(TINY, "packed-hnd", 1, 0, 2)
    with pytest.raises(LayoutError, match=r"^block_ids: ids repeat in \[3, 3\]"):
        plan_copies(mapper, np.array([3, 3]), cache([1000], 16), 5000, H2D)


@pytest.mark.parametrize("host_addr", [-1, 2**64, 1.5, None, True])
def test_bad_host_address_is_refused(host_addr):
    mapper = chunk_mapper(TINY, "packed-hnd", 1, 0, 1)
    with pytest.raises(LayoutError, match="^host_addr: must be a non-negative int address"):
        plan_copies(mapper, np.array([0]), cache([1000], 16), host_addr, D2H)


SMALL = attention_spec(num_layers=1, num_kv_heads=2, head_size=4, dtype="fp16", block_size=3)


@pytest.mark.parametrize("layout,array", [
    # packed-hnd shape, but memory holds (block, token, head, row): a permuted NHD view
    ("packed-hnd", np.zeros((10, 3, 2, 8), np.float16).transpose(0, 2, 1, 3)),
    # every row padded to 16 elements: gaps inside the page
    ("packed-hnd", np.zeros((10, 2, 3, 16), np.float16)[..., :8]),
    # a contiguous tensor of the packed-nhd shape declared packed-hnd
    ("packed-hnd", np.zeros((10, 3, 2, 8), np.float16)),
    # flat pages: the order inside the page cannot be checked
    ("packed-hnd", np.zeros((10, 48), np.float16)),
    # blocks overlapping each other
    ("packed-hnd", np.lib.stride_tricks.as_strided(np.zeros(2000, np.float16), (10, 2, 3, 8),
                                                   (8, 24, 8, 1), writeable=False)),
    # K and V planes aliasing the same memory
    ("separate-kv", np.broadcast_to(np.zeros((10, 3, 2, 4), np.float16), (2, 10, 3, 2, 4))),
    ("separate-kv", np.zeros((3, 10, 3, 2, 4), np.float16)),
    ("packed-hnd", np.zeros((), np.float16)),
])
def test_device_cache_refuses_tensors_not_stored_in_the_layout(layout, array):
    mapper = chunk_mapper(SMALL, layout, 1, 0, 1)
    with pytest.raises(LayoutError, match=rf"^tensors\[0\]: shape .* does not hold layout "
                                          rf"'{layout}'"):
        device_cache(mapper, [NumpyTensor(array)])


@pytest.mark.parametrize("layout,array,block_stride,plane_stride", [
    # vLLM hands HND caches as permuted views: logical (blocks, 2, T, heads, D), memory HND
    ("split-hnd", np.zeros((10, 2, 2, 3, 4), np.float16).transpose(0, 1, 3, 2, 4), 96, 0),
    # every other block of a larger tensor
    ("packed-hnd", np.zeros((20, 2, 3, 8), np.float16)[::2], 192, 0),
    # the same bytes as uint8 (fp8 caches are uint8 tensors)
    ("packed-hnd", np.zeros((10, 2, 3, 16), np.uint8), 96, 0),
    # K and V of a block next to each other: planes interleaved, not overlapping
    ("separate-kv", np.zeros((10, 2, 3, 2, 4), np.float16).transpose(1, 0, 2, 3, 4), 96, 48),
])
def test_device_cache_takes_views_whose_memory_is_the_layout(layout, array, block_stride,
                                                             plane_stride):
    mapper = chunk_mapper(SMALL, layout, 1, 0, 1)
    dev = device_cache(mapper, [NumpyTensor(array)])
    assert (dev.block_strides.tolist(), dev.plane_strides.tolist(), dev.num_blocks) == (
        [block_stride], [plane_stride], 10)
def test_a_job_plan_is_its_chunk_plans_merged_in_chunk_order():
    mapper = chunk_mapper(TINY, "packed-hnd", 1, 0, 2)
    job = plan_job_copies(mapper, np.array([[5, 2], [0, 7]]), cache([1000], 16),
                          np.array([5000, 9000]), D2H)
    assert job.copies_2d.tolist() == [[5000, 16, 1080, 8, 8, 2], [5008, 16, 1032, 8, 8, 2],
                                      [9000, 16, 1000, 8, 8, 2], [9008, 16, 1112, 8, 8, 2]]
    spec = attention_spec(num_layers=2, num_kv_heads=2, head_size=1, dtype="bf16",
                          block_size=2)
    for layout, expand in (("packed-hnd", 1), ("packed-hnd", 2), ("separate-kv", 1)):
        for direction in (D2H, H2D):
            mapper = chunk_mapper(spec, layout, 2, 1, 2)
            ids, addrs = np.array([[3, 1], [0, 6], [7, 2]]), np.array([5000, 6000, 7000])
            dev = cache([1000, 9000], 64, plane_stride=512 if layout == "separate-kv" else 0)
            job = plan_job_copies(mapper, ids, dev, addrs, direction, expand)
            merged = merge_plans([plan_copies(mapper, ids[c], dev, int(addrs[c]), direction,
                                              expand) for c in range(3)])
            assert job.copies_2d.tolist() == merged.copies_2d.tolist()
            assert [a.tolist() for a in (job.dsts, job.srcs, job.sizes)] == \
                [a.tolist() for a in (merged.dsts, merged.srcs, merged.sizes)]


@pytest.mark.parametrize("ids,addrs,message", [
    (np.array([1, 2]), [5000], r"block_ids: must be a 2-D integer array, got int64 shape \(2,\)"),
    (np.array([[1, 2]]), [5000, 6000], r"host_addrs: shape \(2,\), must be \(1,\)"),
    (np.array([[1, 2], [3, 8]]), [5000, 6000], r"block_ids: ids must be in \[0, 8\), got 1..8"),
])
def test_bad_job_input_is_refused(ids, addrs, message):
    mapper = chunk_mapper(TINY, "packed-hnd", 1, 0, 2)
    with pytest.raises(LayoutError, match=message):
        plan_job_copies(mapper, ids, cache([1000], 16), np.array(addrs), D2H)
