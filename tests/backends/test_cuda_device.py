"""cuda-only paths the conformance suite does not reach; they need a GPU and skip without one.

Run on a GPU machine by scripts/gpu_check.sh (step "unit").
"""
from __future__ import annotations

import numpy as np
import pytest

from kvhal.backends.cuda import CudaBackend
from kvhal.hal import host_array

_availability = CudaBackend.probe()
pytestmark = pytest.mark.skipif(not _availability.available,
                                reason=f"backend cuda unavailable: {_availability.reason}")


@pytest.fixture(scope="module")
def cuda():
    return CudaBackend()


def _scatter(cuda, route, n: int, sizes_seed: int) -> None:
    """Pinned -> device -> pinned through `route` (a batch method), scattered slots."""
    rng = np.random.default_rng(sizes_seed)
    slot = 4096
    sizes = rng.integers(1, slot + 1, n).astype(np.uint64)
    sizes[: n // 2] = (sizes[: n // 2] // 16) * 16 + 16  # half aligned, half not
    src, dev, back = cuda.alloc_pinned(n * slot), cuda.alloc_device(n * slot), \
        cuda.alloc_pinned(n * slot)
    stream = cuda.create_stream()
    try:
        host_array(src)[:] = rng.integers(0, 256, n * slot, dtype=np.uint8)
        host_array(back)[:] = 0
        perm = rng.permutation(n).astype(np.uint64) * np.uint64(slot)
        offs = np.arange(n, dtype=np.uint64) * np.uint64(slot)
        route(np.uint64(dev.ptr) + perm, np.uint64(src.ptr) + offs, sizes, stream)
        route(np.uint64(back.ptr) + offs, np.uint64(dev.ptr) + perm, sizes, stream)
        cuda.stream_synchronize(stream)
        s, b = host_array(src), host_array(back)
        for i, k in enumerate(sizes.tolist()):
            assert np.array_equal(b[i * slot:i * slot + k], s[i * slot:i * slot + k]), i
    finally:
        cuda.destroy_stream(stream)
        for a in (src, dev, back):
            cuda.free(a)


@pytest.mark.parametrize("n", [1, 1000, 8192 + 7])
def test_kernel_batch_round_trips(cuda, n):
    _scatter(cuda, cuda.copy_batch_kernel_async, n, n)


@pytest.mark.parametrize("n", [1, 8192 + 7])
def test_native_batch_h2d_from_pinned_round_trips(cuda, n):
    _scatter(cuda, cuda.copy_batch_async, n, n + 1)
