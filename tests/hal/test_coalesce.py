"""coalesce_batch: exact re-cut descriptors, and the same bytes moved for any batch."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhal.backends.cpu import CpuBackend
from kvhal.backends.cpu.backend import MEMMOVE_PIECE_BYTES
from kvhal.hal import address_array, coalesce_batch, host_array


def _u64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.uint64)


def _recut(dsts, srcs, sizes, max_bytes):
    return [a.tolist() for a in coalesce_batch(_u64(*dsts), _u64(*srcs), _u64(*sizes),
                                               max_bytes)]


def test_continuing_descriptors_merge_in_order():
    assert _recut([1000, 1100, 1200, 5000, 5100], [0, 100, 200, 300, 400],
                  [100, 100, 100, 50, 100], 1000) == [[1000, 5000, 5100], [0, 300, 400],
                                                      [300, 50, 100]]


def test_only_both_sides_continuing_merge():
    # dst continues but src does not, then src continues but dst does not
    assert _recut([0, 100, 900], [5000, 7000, 7100], [100, 100, 100], 1000) == [
        [0, 100, 900], [5000, 7000, 7100], [100, 100, 100]]


def test_long_ranges_split_into_pieces_from_their_start():
    assert _recut([1000], [9000], [250], 100) == [[1000, 1100, 1200], [9000, 9100, 9200],
                                                  [100, 100, 50]]
    # three continuing 100-byte blocks -> one 300-byte range -> 128 + 128 + 44
    assert _recut([0, 100, 200, 4000], [800, 900, 1000, 0], [100, 100, 100, 128], 128) == [
        [0, 128, 256, 4000], [800, 928, 1056, 0], [128, 128, 44, 128]]


def test_nothing_to_do_returns_the_inputs():
    d, s, n = _u64(0, 500), _u64(1000, 2000), _u64(100, 100)
    out = coalesce_batch(d, s, n, 100)
    assert out[0] is d and out[1] is s and out[2] is n
    empty = _u64()
    assert [a.size for a in coalesce_batch(empty, empty, empty, 100)] == [0, 0, 0]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.booleans()), min_size=1, max_size=30),
       st.integers(1, 64), st.randoms(use_true_random=False))
def test_recut_moves_exactly_the_same_bytes(blocks, max_bytes, rnd):
    """Random blocks (each continuing the previous one or not) between two disjoint buffers:
    every (dst byte ← src byte) pair is the same before and after, pieces ≤ max_bytes."""
    dsts, srcs, sizes, d, s = [], [], [], 0, 10_000
    for size, continues in blocks:
        if not continues:
            d, s = d + rnd.randint(1, 50), s + rnd.randint(1, 50)
        dsts.append(d), srcs.append(s), sizes.append(size)
        d, s = d + size, s + size
    out = coalesce_batch(_u64(*dsts), _u64(*srcs), _u64(*sizes), max_bytes)

    def pairs(dd, ss, nn):
        return sorted((int(a) + i, int(b) + i) for a, b, n in zip(dd, ss, nn)
                      for i in range(int(n)))

    assert pairs(*out) == pairs(dsts, srcs, sizes)
    assert int(out[2].max()) <= max_bytes and int(out[2].min()) > 0


def test_cpu_batch_copies_merged_and_split_ranges_exactly():
    """On the cpu backend: continuing 128 KiB blocks (merged, then cut at MEMMOVE_PIECE_BYTES)
    and scattered ones land byte-exact; so does one 1.25 MiB descriptor (split)."""
    backend = CpuBackend()
    block = 128 << 10
    src, dst = backend.alloc_device(16 * block), backend.alloc_pinned(16 * block)
    stream = backend.create_stream()
    try:
        data = np.random.default_rng(3).integers(0, 256, src.nbytes, dtype=np.uint8)
        address_array(src.ptr, src.nbytes)[:] = data
        order = list(range(6)) + list(range(15, 5, -1))  # dst block i <- src block order[i]
        backend.copy_batch_async(_u64(*(dst.ptr + i * block for i in range(16))),
                                 _u64(*(src.ptr + b * block for b in order)),
                                 _u64(*([block] * 16)), stream)
        backend.stream_synchronize(stream)
        expect = np.concatenate([data[b * block:(b + 1) * block] for b in order])
        assert np.array_equal(host_array(dst), expect)
        assert 10 * block > 2 * MEMMOVE_PIECE_BYTES  # cut into 3 pieces
        backend.copy_batch_async(_u64(dst.ptr), _u64(src.ptr), _u64(10 * block), stream)
        backend.stream_synchronize(stream)
        expect[:10 * block] = data[:10 * block]
        assert np.array_equal(host_array(dst), expect)
    finally:
        backend.destroy_stream(stream)
        backend.free(src)
        backend.free(dst)
