"""An NVRTC-compiled gather/scatter copy kernel for batches of many small blocks.

One launch copies a whole descriptor chunk: thread block b walks descriptors b, b + grid, ...,
and its threads copy each range with 16-byte loads/stores when destination, source and size are
16-byte aligned, byte-wise otherwise. Host endpoints must be pinned or registered memory (the
kernel reads/writes them over the bus through unified addressing; `register_host` maps them).

The descriptor arrays themselves live in pinned host memory, in a ring of `RING_SLOTS` slots;
a slot is reused only after the event recorded behind its last launch has completed, so a
descriptor is never overwritten while a kernel may still read it.

Compilation needs NVRTC (`nvidia-cuda-nvrtc`, kvhal's 'cuda-nvrtc' extra) but no GPU; the
cubin targets the device's exact compute capability. Launching uses cuda-python's driver API
(`cuModuleLoadData`, `cuLaunchKernel`) on the stream the runtime created.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np

from kvhal.hal import HalError, NotSupportedError, Stream, host_array

KERNEL_NAME = "kvhal_copy_blocks"
SOURCE = r"""
extern "C" __global__ void kvhal_copy_blocks(const unsigned long long* dsts,
                                             const unsigned long long* srcs,
                                             const unsigned long long* sizes,
                                             unsigned long long n) {
  for (unsigned long long i = blockIdx.x; i < n; i += gridDim.x) {
    unsigned long long d = dsts[i], s = srcs[i], len = sizes[i];
    if (((d | s | len) & 15ull) == 0) {
      uint4* d4 = (uint4*)d;
      const uint4* s4 = (const uint4*)s;
      for (unsigned long long j = threadIdx.x; j < (len >> 4); j += blockDim.x) d4[j] = s4[j];
    } else {
      unsigned char* d1 = (unsigned char*)d;
      const unsigned char* s1 = (const unsigned char*)s;
      for (unsigned long long j = threadIdx.x; j < len; j += blockDim.x) d1[j] = s1[j];
    }
  }
}
"""
#: Threads per block, and the cap on blocks per launch (descriptors beyond it are strided).
THREADS, MAX_GRID = 256, 4096
#: Descriptor ring: slots, each holding one chunk of dsts, srcs and sizes (uint64).
RING_SLOTS = 4


def compile_cubin(arch: int) -> bytes:
    """Compile `SOURCE` to a cubin for compute capability `arch` (e.g. 90 for sm_90).

    Raises:
        NotSupportedError: NVRTC is not installed, or compilation failed (with NVRTC's log).
    """
    try:
        from cuda.bindings import nvrtc
        err, prog = nvrtc.nvrtcCreateProgram(SOURCE.encode(), b"kvhal_copy.cu", 0, [], [])
    except Exception as exc:  # noqa: BLE001 - a missing libnvrtc raises from cuda-pathfinder
        raise NotSupportedError(f"NVRTC unavailable ({exc.__class__.__name__}: {exc}); "
                                "install kvhal's 'cuda-nvrtc' extra", backend="cuda",
                                api="nvrtcCreateProgram") from None
    try:
        options = [f"--gpu-architecture=sm_{arch}".encode()]
        (status,) = nvrtc.nvrtcCompileProgram(prog, len(options), options)
        if int(status) != 0:
            _, size = nvrtc.nvrtcGetProgramLogSize(prog)
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            text = log.rstrip(bytes(1)).decode(errors="replace").strip()
            raise NotSupportedError(f"NVRTC failed for sm_{arch}: {text}", backend="cuda",
                                    code=int(status), api="nvrtcCompileProgram")
        _, size = nvrtc.nvrtcGetCUBINSize(prog)
        cubin = b" " * size
        nvrtc.nvrtcGetCUBIN(prog, cubin)
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _driver_check(result: Any, api: str) -> Any:
    err = result[0]
    if int(err) != 0:
        raise HalError(f"{api} failed: {getattr(err, 'name', err)}", backend="cuda",
                       code=int(err), api=api)
    return result[1] if len(result) > 1 else None


class CopyKernel:
    """The loaded kernel plus its pinned descriptor ring, for one backend and device.

    Args:
        backend: The `CudaBackend` (for pinned memory, events and the device).
        max_descriptors: Descriptors per launch (one ring slot).

    Raises:
        NotSupportedError: NVRTC is missing or compilation failed.
        HalError: loading the module failed.
    """

    def __init__(self, backend: Any, max_descriptors: int):
        from cuda.bindings import driver
        self._driver = driver
        self._backend = backend
        self.max_descriptors = max_descriptors
        cubin = compile_cubin(backend.compute_capability())
        backend._call("set_device", backend.device)
        self._module = _driver_check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
        self._function = _driver_check(
            driver.cuModuleGetFunction(self._module, KERNEL_NAME.encode()),
            "cuModuleGetFunction")
        self._ring = backend.alloc_pinned(RING_SLOTS * 3 * 8 * max_descriptors)
        self._slots = host_array(self._ring).view(np.uint64).reshape(RING_SLOTS, 3,
                                                                       max_descriptors)
        self._events = [backend.create_event() for _ in range(RING_SLOTS)]
        self._next = 0
        self._lock = threading.Lock()

    def launch(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray,
               stream: Stream) -> None:
        """Queue one kernel launch for ≤ `max_descriptors` validated uint64 descriptors."""
        n = len(sizes)
        with self._lock:
            slot, self._next = self._next, (self._next + 1) % RING_SLOTS
            self._backend.event_synchronize(self._events[slot])  # slot's last reader is done
            table = self._slots[slot]
            table[0, :n], table[1, :n], table[2, :n] = dsts, srcs, sizes
            base = self._ring.ptr + slot * 3 * 8 * self.max_descriptors
            args = ((base, base + 8 * self.max_descriptors, base + 16 * self.max_descriptors, n),
                    (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ulonglong))
            _driver_check(self._driver.cuLaunchKernel(
                self._function, min(n, MAX_GRID), 1, 1, THREADS, 1, 1, 0, stream.handle, args,
                0), "cuLaunchKernel")
            self._backend.record_event(self._events[slot], stream)
