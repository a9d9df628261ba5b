"""torch tensors and streams handed to a backend (CPU tensors here; no accelerator)."""
from __future__ import annotations

import numpy as np
import pytest

from kvhal.backends._runtime.interop import tensor_allocation, tensor_device, tensor_span
from kvhal.backends.cpu import CpuBackend
from kvhal.hal import InvalidValueError, MemoryKind, host_array

torch = pytest.importorskip("torch", reason="torch is not installed (kvhal's 'vllm' extra)")


def test_contiguous_span_is_numel_times_itemsize():
    t = torch.zeros((4, 3, 16), dtype=torch.float16)
    assert tensor_span(t) == (t.data_ptr(), 4 * 3 * 16 * 2)


def test_strided_view_spans_first_to_last_element():
    base = torch.zeros((8, 10), dtype=torch.int32)
    view = base[2:5, 1:4]  # rows 2..4, columns 1..3 of a 10-wide int32 matrix
    assert tensor_span(view) == (base.data_ptr() + (2 * 10 + 1) * 4, (2 * 10 + 2 + 1) * 4)


def test_empty_tensor_has_zero_span():
    assert tensor_span(torch.zeros((0, 5)))[1] == 0


def test_cpu_tensor_is_host():
    assert tensor_device(torch.zeros(3)) == -1


def test_cpu_tensor_is_registered_and_copied_into():
    backend = CpuBackend()
    t = torch.zeros(4096, dtype=torch.uint8)
    dst = tensor_allocation(backend, t)
    src = backend.alloc_pinned(4096)
    host_array(src)[:] = np.arange(4096, dtype=np.uint8)
    stream = backend.create_stream()
    try:
        assert (dst.kind, dst.ptr, dst.nbytes) == (MemoryKind.REGISTERED, t.data_ptr(), 4096)
        backend.copy_async(dst.ptr, src.ptr, 4096, stream)
        backend.stream_synchronize(stream)
        assert np.array_equal(t.numpy(), np.arange(4096, dtype=np.uint8))
    finally:
        backend.destroy_stream(stream)
        backend.free(dst)
        backend.free(src)


def test_empty_tensor_is_refused():
    with pytest.raises(InvalidValueError, match="empty tensor"):
        tensor_allocation(CpuBackend(), torch.zeros(0))
