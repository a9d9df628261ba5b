"""The cuda backend: the shared runtime adapter over cuda-python's `cuda.bindings.runtime`."""
from __future__ import annotations

from typing import ClassVar

from kvhal.backends._runtime import RuntimeBackend, VendorTable

from .table import CUDA


class CudaBackend(RuntimeBackend):
    """`DeviceBackend` on NVIDIA GPUs through the CUDA runtime (see `RuntimeBackend`)."""

    name: ClassVar[str] = "cuda"
    table: ClassVar[VendorTable] = CUDA
