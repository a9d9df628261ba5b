"""Batch path selection by runtime version, and chunking at the descriptor limit."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from kvhal.backends._runtime import BatchMode, chunk_bounds, select_batch_mode, uses_native
from kvhal.backends._runtime.batch import LOOP_CHUNK
from kvhal.backends.cuda.table import CUDA
from kvhal.backends.rocm.table import ROCM


@pytest.mark.parametrize("runtime,driver,expected", [
    (12060, 12060, BatchMode(False, LOOP_CHUNK, False, "runtime 12.6 < 12.8 has no "
                             "cudaMemcpyBatchAsync; per-copy loop")),
    (12080, 12080, BatchMode(True, 8192, True)),
    (12090, 13000, BatchMode(True, 8192, True)),
    (13000, 13000, BatchMode(True, 8192, False)),
    (13040, 0, BatchMode(True, 8192, False)),
    (13040, 12060, BatchMode(False, LOOP_CHUNK, False, "driver 12.6 < 12.8 has no "
                             "cudaMemcpyBatchAsync; per-copy loop")),
], ids=["12.6", "12.8", "12.9", "13.0", "13.4-nodriver", "13.4-old-driver"])
def test_cuda_batch_mode_by_version(runtime, driver, expected):
    assert select_batch_mode(CUDA, runtime, driver, True) == expected


@pytest.mark.parametrize("runtime,native", [(60_400_000, False), (70_000_000, True),
                                            (70_253_211, True)], ids=["6.4", "7.0", "7.2"])
def test_rocm_batch_mode_by_version(runtime, native):
    mode = select_batch_mode(ROCM, runtime, runtime, True)
    assert (mode.native, mode.fail_idx) == (native, native)
    assert mode.max_descriptors == (8192 if native else LOOP_CHUNK)


def test_missing_symbol_means_loop():
    mode = select_batch_mode(ROCM, 70_200_000, 70_200_000, False)
    assert mode == BatchMode(False, LOOP_CHUNK, False,
                             "hipMemcpyBatchAsync not found in libamdhip64.so; per-copy loop")


def test_legacy_default_stream_falls_back_to_loop():
    native = BatchMode(True, 8192, False)
    assert uses_native(native, CUDA, 0) is False
    assert uses_native(native, CUDA, 0x5555) is True
    assert uses_native(BatchMode(False, LOOP_CHUNK, False, "x"), CUDA, 0x5555) is False


@pytest.mark.parametrize("n,expected", [(0, []), (1, [(0, 1)]), (8192, [(0, 8192)]),
                                        (8193, [(0, 8192), (8192, 8193)]),
                                        (20000, [(0, 8192), (8192, 16384), (16384, 20000)])])
def test_chunk_bounds_at_the_rocm_limit(n, expected):
    assert chunk_bounds(n, ROCM.batch.max_descriptors) == expected


# no deadline: up to 100k bounds per example exceed hypothesis' 200 ms on a loaded machine
@settings(deadline=None)
@given(st.integers(0, 100_000), st.integers(1, 10_000))
def test_chunk_bounds_tile_the_batch(n, limit):
    bounds = chunk_bounds(n, limit)
    starts, ends = [lo for lo, _ in bounds], [hi for _, hi in bounds]
    assert starts == [0] + ends[:-1] if bounds else n == 0
    assert (ends[-1] if bounds else 0) == n
    assert all(0 < hi - lo <= limit for lo, hi in bounds)
    assert len(bounds) == -(-n // limit)


def test_chunk_bounds_rejects_a_zero_limit():
    with pytest.raises(ValueError, match="limit=0"):
        chunk_bounds(5, 0)
