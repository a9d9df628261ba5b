"""The cuda backend: the shared runtime adapter over cuda-python's `cuda.bindings.runtime`,
plus the optional NVRTC copy kernel (`copy_batch_kernel_async`)."""
from __future__ import annotations

import dataclasses
import threading
from typing import ClassVar

import numpy as np

from kvhal.backends._runtime import RuntimeBackend, VendorTable, chunk_bounds
from kvhal.hal import Capabilities, Stream

from .kernel import CopyKernel

from .table import CUDA


def nvrtc_status() -> tuple[bool, str]:
    """(True, 'NVRTC <major>.<minor>') if NVRTC loads, else (False, why not), for
    `capabilities().notes`."""
    try:
        from cuda.bindings import nvrtc
        err, major, minor = nvrtc.nvrtcVersion()
    except Exception as exc:  # noqa: BLE001 - a missing libnvrtc raises from cuda-pathfinder
        return False, (f"NVRTC unavailable ({exc.__class__.__name__}); install kvhal's "
                       "'cuda-nvrtc' extra")
    if int(err) != 0:
        return False, f"nvrtcVersion failed: {err}"
    return True, f"NVRTC {major}.{minor}"


class CudaBackend(RuntimeBackend):
    """`DeviceBackend` on NVIDIA GPUs through the CUDA runtime (see `RuntimeBackend`)."""

    name: ClassVar[str] = "cuda"
    table: ClassVar[VendorTable] = CUDA

    def _configure(self, **state) -> None:
        super()._configure(**state)
        self._kernel: CopyKernel | None = None
        self._kernel_guard = threading.Lock()

    def capabilities(self) -> Capabilities:
        """`RuntimeBackend.capabilities` plus whether the copy kernel can be built."""
        caps = super().capabilities()
        ok, status = nvrtc_status()
        kernel = ("copy kernel selectable per transfer (copy_batch_kernel_async), " + status
                  if ok else "copy kernel off: " + status)
        return dataclasses.replace(caps, notes=caps.notes + (kernel,))

    def compute_capability(self) -> int:
        """Compute capability of `self.device` as major*10 + minor (e.g. 90 for sm_90)."""
        attr = self._rt.cudaDeviceAttr
        major = self._call("device_attribute", attr.cudaDevAttrComputeCapabilityMajor,
                           self.device)
        minor = self._call("device_attribute", attr.cudaDevAttrComputeCapabilityMinor,
                           self.device)
        return int(major) * 10 + int(minor)

    def copy_batch_kernel_async(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray,
                                stream: Stream) -> None:
        """`copy_batch_async` through the NVRTC gather/scatter kernel instead of DMA.

        Same arguments, validation and ordering as `copy_batch_async`; host endpoints must be
        pinned or registered. The kernel is compiled on first use (tens of ms).

        Raises:
            InvalidValueError: as `copy_batch_async`.
            NotSupportedError: NVRTC is missing or the kernel does not compile.
        """
        self._stream(stream)
        d, s, n = self._batch_arrays(dsts, srcs, sizes)
        if len(n) == 0:
            return
        with self._kernel_guard:
            if self._kernel is None:
                self._kernel = CopyKernel(self, self.batch_mode.max_descriptors)
        for lo, hi in chunk_bounds(len(n), self._kernel.max_descriptors):
            self._kernel.launch(d[lo:hi], s[lo:hi], n[lo:hi], stream)
