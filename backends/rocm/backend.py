"""The rocm backend: the shared runtime adapter over hip-python's `hip.hip`."""
from __future__ import annotations

from typing import ClassVar

from kvhal.backends._runtime import RuntimeBackend, VendorTable

from .table import ROCM


class RocmBackend(RuntimeBackend):
    """`DeviceBackend` on AMD GPUs through the HIP runtime (see `RuntimeBackend`)."""

    name: ClassVar[str] = "rocm"
    table: ClassVar[VendorTable] = ROCM
