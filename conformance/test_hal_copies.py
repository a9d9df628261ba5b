"""HAL conformance: 1D, 2D and batch copies, byte for byte against a numpy reference."""
from __future__ import annotations

import numpy as np
import pytest

from kvhal.hal import InvalidValueError

from .hal_helpers import alloc_kind, read, reference_bytes, refused, write

DIRECTIONS = {"H2D": ("host", "device"), "D2H": ("device", "host"),
              "D2D": ("device", "device"), "H2H": ("host", "host")}
SIZES = [1, 7, 4096, 65537, 1 << 20, 16 << 20]


@pytest.fixture
def stream(backend):
    s = backend.create_stream()
    yield s
    backend.destroy_stream(s)


@pytest.mark.parametrize("nbytes", SIZES)
@pytest.mark.parametrize("direction", list(DIRECTIONS))
@pytest.mark.parametrize("offsets", [(0, 0), (3, 5)], ids=["aligned", "odd-offsets"])
def test_copy_async(backend, stream, direction, nbytes, offsets):
    src_kind, dst_kind = DIRECTIONS[direction]
    src_off, dst_off = offsets
    src = alloc_kind(backend, src_kind, nbytes + src_off + 8)
    dst = alloc_kind(backend, dst_kind, nbytes + dst_off + 8)
    try:
        src_data = reference_bytes(src.nbytes, seed=nbytes)
        dst_data = reference_bytes(dst.nbytes, seed=nbytes + 1)
        write(backend, src, src_data)
        write(backend, dst, dst_data)
        backend.copy_async(dst.ptr + dst_off, src.ptr + src_off, nbytes, stream)
        backend.stream_synchronize(stream)
        expected = dst_data.copy()
        expected[dst_off:dst_off + nbytes] = src_data[src_off:src_off + nbytes]
        np.testing.assert_array_equal(read(backend, dst), expected)
    finally:
        backend.free(src)
        backend.free(dst)


def test_zero_byte_copy_is_noop(backend, stream):
    buf = backend.alloc_device(16)
    try:
        write(backend, buf, np.arange(16, dtype=np.uint8))
        backend.copy_async(buf.ptr, buf.ptr + 8, 0, stream)
        backend.stream_synchronize(stream)
        np.testing.assert_array_equal(read(backend, buf), np.arange(16, dtype=np.uint8))
    finally:
        backend.free(buf)


CASES_2D = [  # (width, src_pitch, dst_pitch, height)
    (1, 1, 1, 1), (1, 3, 2, 17), (3, 7, 5, 9), (64, 256, 64, 64), (64, 64, 256, 64),
    (4096, 4096, 4096, 32), (100, 4096, 128, 300),
]


@pytest.mark.parametrize("width,src_pitch,dst_pitch,height", CASES_2D,
                         ids=lambda v: str(v))
@pytest.mark.parametrize("direction", ["H2D", "D2H", "D2D"])
def test_copy_2d_async(backend, stream, direction, width, src_pitch, dst_pitch, height):
    src_kind, dst_kind = DIRECTIONS[direction]
    src = alloc_kind(backend, src_kind, src_pitch * height + 3)
    dst = alloc_kind(backend, dst_kind, dst_pitch * height + 3)
    try:
        src_data = reference_bytes(src.nbytes, seed=width * 31 + height)
        dst_data = reference_bytes(dst.nbytes, seed=width * 17 + height)
        write(backend, src, src_data)
        write(backend, dst, dst_data)
        backend.copy_2d_async(dst.ptr + 1, dst_pitch, src.ptr + 2, src_pitch, width, height,
                              stream)
        backend.stream_synchronize(stream)
        expected = dst_data.copy()
        for row in range(height):
            d, s = 1 + row * dst_pitch, 2 + row * src_pitch
            expected[d:d + width] = src_data[s:s + width]
        np.testing.assert_array_equal(read(backend, dst), expected)
    finally:
        backend.free(src)
        backend.free(dst)


@pytest.mark.parametrize("which", ["src_pitch", "dst_pitch"])
def test_copy_2d_pitch_below_width_is_invalid(backend, stream, which):
    buf = backend.alloc_device(1 << 16)
    try:
        pitches = {"src_pitch": 64, "dst_pitch": 64, which: 32}
        with refused(which):
            backend.copy_2d_async(buf.ptr, pitches["dst_pitch"], buf.ptr + 8192,
                                  pitches["src_pitch"], 48, 4, stream)
    finally:
        backend.free(buf)


def _batch_case(backend, stream, n: int, max_size: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, max_size + 1, n).astype(np.uint64)
    slots = int(sizes.max()) if n else 1
    src = backend.alloc_device(max(n, 1) * slots)
    dst = backend.alloc_pinned(max(n, 1) * slots)
    try:
        src_data = reference_bytes(src.nbytes, seed)
        dst_data = reference_bytes(dst.nbytes, seed + 1)
        write(backend, src, src_data)
        write(backend, dst, dst_data)
        src_slot = rng.permutation(n).astype(np.uint64)
        dst_slot = rng.permutation(n).astype(np.uint64)
        srcs = np.uint64(src.ptr) + src_slot * np.uint64(slots)
        dsts = np.uint64(dst.ptr) + dst_slot * np.uint64(slots)
        backend.copy_batch_async(dsts, srcs, sizes, stream)
        backend.stream_synchronize(stream)
        expected = dst_data.copy()
        for i in range(n):
            s, d, k = int(src_slot[i]) * slots, int(dst_slot[i]) * slots, int(sizes[i])
            expected[d:d + k] = src_data[s:s + k]
        np.testing.assert_array_equal(read(backend, dst), expected)
    finally:
        backend.free(src)
        backend.free(dst)


@pytest.mark.parametrize("n", [0, 1, 1000])
def test_copy_batch_async(backend, stream, n):
    _batch_case(backend, stream, n, max_size=4096, seed=n)


def test_copy_batch_beyond_descriptor_limit(backend, stream):
    n = backend.capabilities().max_batch_descriptors + 5
    _batch_case(backend, stream, n, max_size=16, seed=99)


def test_copy_batch_mismatched_lengths_is_invalid(backend, stream):
    buf = backend.alloc_device(4096)
    try:
        with pytest.raises(InvalidValueError):
            backend.copy_batch_async(np.array([buf.ptr, buf.ptr + 64], dtype=np.uint64),
                                     np.array([buf.ptr + 1024], dtype=np.uint64),
                                     np.array([8, 8], dtype=np.uint64), stream)
    finally:
        backend.free(buf)


def _copies_2d_case(backend, stream, direction: str, n: int, seed: int) -> None:
    """n 2D copies of mixed shapes (a zero-width and a zero-height row among them) in one
    `copy_2d_batch_async`, each between its own src and dst slot, checked byte for byte."""
    rng = np.random.default_rng(seed)
    shapes = [CASES_2D[i % len(CASES_2D)] for i in range(n)]
    if n > 2:
        shapes[1], shapes[2] = (0, 8, 8, 4), (16, 16, 16, 0)
    slot = max(max(sp, dp) * h + w for w, sp, dp, h in shapes) if n else 1
    src_kind, dst_kind = DIRECTIONS[direction]
    src = alloc_kind(backend, src_kind, max(n, 1) * slot + 3)
    dst = alloc_kind(backend, dst_kind, max(n, 1) * slot + 5)
    try:
        src_data = reference_bytes(src.nbytes, seed)
        dst_data = reference_bytes(dst.nbytes, seed + 1)
        write(backend, src, src_data)
        write(backend, dst, dst_data)
        src_off = rng.permutation(n) * slot + 3
        dst_off = rng.permutation(n) * slot + 5
        copies = np.array([[dst.ptr + int(d), dp, src.ptr + int(s), sp, w, h] for
                           (w, sp, dp, h), s, d in zip(shapes, src_off, dst_off)],
                          dtype=np.uint64).reshape(n, 6)
        backend.copy_2d_batch_async(copies, stream)
        backend.stream_synchronize(stream)
        expected = dst_data.copy()
        for (w, sp, dp, h), s, d in zip(shapes, src_off, dst_off):
            for row in range(h):
                expected[d + row * dp:d + row * dp + w] = src_data[s + row * sp:s + row * sp + w]
        np.testing.assert_array_equal(read(backend, dst), expected)
    finally:
        backend.free(src)
        backend.free(dst)


@pytest.mark.parametrize("n", [0, 1, 64])
@pytest.mark.parametrize("direction", ["H2D", "D2H", "D2D"])
def test_copy_2d_batch_async(backend, stream, direction, n):
    _copies_2d_case(backend, stream, direction, n, seed=n + len(direction))


@pytest.mark.parametrize("bad", [
    {"shape": (3, 5)}, {"shape": (6,)}, {"shape": (2, 6, 1)}, {"dtype": np.float64},
    {"row": [0, 32, 2048, 64, 48, 4]}, {"row": [0, 64, 2048, 32, 48, 4]},
    {"row": [0, 64, 1 << 40, 64, 48, 4]}, {"row": [0, 64, 2048, 64, 48, 1 << 62]},
], ids=["shape-3x5", "shape-6", "shape-3d", "float", "dst_pitch<width", "src_pitch<width",
        "src-outside", "span-past-2**64"])
def test_copy_2d_batch_invalid_queues_nothing(backend, stream, bad):
    """A bad batch raises InvalidValueError at the call and queues none of its copies."""
    buf = backend.alloc_device(1 << 16)
    try:
        data = reference_bytes(buf.nbytes, seed=7)
        write(backend, buf, data)
        good = [buf.ptr + 8192, 64, buf.ptr + 16384, 64, 48, 4]
        rows = [good] + ([[buf.ptr + v if i in (0, 2) and v < (1 << 40) else v
                           for i, v in enumerate(bad["row"])]] if "row" in bad else [])
        copies = np.array(rows, dtype=bad.get("dtype", np.uint64))
        if "shape" in bad:
            copies = np.resize(copies.ravel(), bad["shape"])
        with pytest.raises(InvalidValueError):
            backend.copy_2d_batch_async(copies, stream)
        backend.stream_synchronize(stream)
        np.testing.assert_array_equal(read(backend, buf), data)
    finally:
        backend.free(buf)
