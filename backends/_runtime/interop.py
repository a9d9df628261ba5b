"""Handing torch tensors and streams to a backend (for the vLLM integration).

torch is imported only inside the functions that need it, never at module import, so the HAL
stays importable without torch. On ROCm builds torch exposes HIP through the same `torch.cuda`
API (`device.type == "cuda"`, `Stream.cuda_stream` is a `hipStream_t`), so one helper serves both
backends.
"""
from __future__ import annotations

from typing import Any

from kvhal.hal import Allocation, InvalidValueError


def tensor_span(tensor: Any) -> tuple[int, int]:
    """(address, nbytes) of the bytes a tensor's elements occupy, from `data_ptr()`, its shape,
    strides (elements) and `element_size()`; a non-contiguous view spans first to last element.

    Raises:
        InvalidValueError: a negative stride (the span would start before `data_ptr()`).
    """
    shape, strides = tuple(tensor.shape), tuple(tensor.stride())
    if any(s < 0 for s in strides):
        raise InvalidValueError(f"tensor has negative strides {strides}", backend="interop")
    if 0 in shape:
        return int(tensor.data_ptr()), 0
    last = sum((n - 1) * s for n, s in zip(shape, strides))
    return int(tensor.data_ptr()), (last + 1) * int(tensor.element_size())


def tensor_device(tensor: Any) -> int:
    """Accelerator ordinal of a tensor; -1 for a host (CPU) tensor."""
    device = tensor.device
    if device.type == "cpu":
        return -1
    if device.index is not None:
        return int(device.index)
    import torch
    return int(torch.cuda.current_device())


def tensor_allocation(backend: Any, tensor: Any) -> Allocation:
    """Make a tensor's memory a copy endpoint of `backend`.

    An accelerator tensor is adopted (`backend.adopt_device`: torch keeps ownership); a CPU
    tensor is registered (`backend.register_host`: page-locked until `free`). Call
    `backend.free(allocation)` before the tensor is released.

    Raises:
        InvalidValueError: an empty tensor, negative strides, or a device tensor on a backend
            without `adopt_device` (e.g. cpu).
    """
    ptr, nbytes = tensor_span(tensor)
    device = tensor_device(tensor)
    if nbytes == 0:
        raise InvalidValueError("cannot hand an empty tensor to the HAL", backend=backend.name)
    if device < 0:
        return backend.register_host(ptr, nbytes)
    adopt = getattr(backend, "adopt_device", None)
    if adopt is None:
        raise InvalidValueError(f"backend {backend.name} cannot adopt device tensors",
                                backend=backend.name)
    return adopt(ptr, nbytes, device)
