"""Vendor tables: everything that differs between the CUDA and HIP runtime APIs, as data.

The shared adapter (`backends._runtime`) calls runtime functions by *operation* ("malloc",
"memcpy_2d_async", ...). A `VendorTable` turns an operation into the vendor's function name
(prefix + the CUDA suffix, unless the vendor overrides it), names the constants, the error enum
and the batch-copy quirks. HIP copied CUDA's names almost everywhere, so a vendor table is a
prefix and a handful of overrides.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvhal.hal import (BackendUnavailableError, DeviceFaultError, HalError, InvalidValueError,
                       NotSupportedError, OutOfMemoryError)

#: Operation -> CUDA-style suffix (the vendor prefix goes in front).
OPERATIONS: dict[str, str] = {
    "get_device_count": "GetDeviceCount", "set_device": "SetDevice",
    "runtime_version": "RuntimeGetVersion", "driver_version": "DriverGetVersion",
    "device_attribute": "DeviceGetAttribute", "error_name": "GetErrorName",
    "error_string": "GetErrorString",
    "malloc": "Malloc", "free": "Free", "host_alloc": "HostAlloc", "free_host": "FreeHost",
    "host_register": "HostRegister", "host_unregister": "HostUnregister",
    "stream_create": "StreamCreateWithFlags", "stream_destroy": "StreamDestroy",
    "stream_synchronize": "StreamSynchronize", "stream_query": "StreamQuery",
    "stream_wait_event": "StreamWaitEvent", "event_create": "EventCreateWithFlags",
    "event_destroy": "EventDestroy", "event_record": "EventRecord",
    "event_query": "EventQuery", "event_synchronize": "EventSynchronize",
    "event_elapsed": "EventElapsedTime", "memcpy_async": "MemcpyAsync",
    "memcpy_2d_async": "Memcpy2DAsync", "memcpy_batch_async": "MemcpyBatchAsync",
}

#: Constant -> CUDA-style suffix.
CONSTANTS: dict[str, str] = {
    "stream_non_blocking": "StreamNonBlocking", "event_default": "EventDefault",
    "event_disable_timing": "EventDisableTiming", "host_alloc_portable": "HostAllocPortable",
    "host_register_portable": "HostRegisterPortable", "host_register_mapped": "HostRegisterMapped",
}

#: HAL error class -> error-enum suffixes (resolved per vendor; names a vendor lacks are
#: skipped). Sources: `cudaError_t` in cuda-python 13.4 `cuda.bindings.runtime`, `hipError_t`
#: in hip-python 10.0 `hip.hip` (values printed side by side in tests/backends).
ERROR_CLASSES: dict[type[HalError], tuple[str, ...]] = {
    OutOfMemoryError: ("ErrorMemoryAllocation", "ErrorOutOfMemory"),
    InvalidValueError: ("ErrorInvalidValue", "ErrorInvalidDevice", "ErrorInvalidDevicePointer",
                        "ErrorInvalidPitchValue", "ErrorInvalidMemcpyDirection",
                        "ErrorInvalidResourceHandle", "ErrorInvalidHandle",
                        "ErrorHostMemoryAlreadyRegistered", "ErrorHostMemoryNotRegistered"),
    NotSupportedError: ("ErrorNotSupported", "ErrorNotPermitted",
                        "ErrorCallRequiresNewerDriver"),
    BackendUnavailableError: ("ErrorInsufficientDriver", "ErrorNoDevice", "ErrorStubLibrary",
                              "ErrorInitializationError", "ErrorSystemDriverMismatch",
                              "ErrorCompatNotSupportedOnDevice", "ErrorDevicesUnavailable"),
    DeviceFaultError: ("ErrorIllegalAddress", "ErrorLaunchFailure", "ErrorECCUncorrectable",
                       "ErrorECCNotCorrectable", "ErrorHardwareStackError",
                       "ErrorIllegalInstruction", "ErrorMisalignedAddress",
                       "ErrorInvalidAddressSpace", "ErrorInvalidPc", "ErrorLaunchTimeout",
                       "ErrorLaunchTimeOut", "ErrorAssert", "ErrorPriorLaunchFailure",
                       "ErrorContextIsDestroyed"),
}


@dataclass(frozen=True, slots=True)
class BatchQuirks:
    """How (and whether) a vendor's native batch copy may be used.

    Attributes:
        min_runtime: Lowest runtime version (vendor encoding) that has the batch call.
        fail_idx_below: Runtimes below this version take a `failIdx` out-argument; None if the
            call always takes one.
        max_descriptors: Descriptors per call; larger batches are cut into chunks.
        attributes: True if the call needs one attribute set (CUDA requires `numAttrs ≥ 1`);
            False if it must get `numAttrs = 0` (ROCm 7.2 rejects `numAttrs > 0`).
        via_ctypes: True if the binding's generated wrapper cannot pass arrays, so the symbol is
            called through ctypes on `library` (hip-python treats the arrays as outputs).
        library: Shared library holding the symbol for `via_ctypes`.
        rejects_legacy_stream: True if the legacy default stream (handle 0) is refused.
    """

    min_runtime: int
    fail_idx_below: int | None
    max_descriptors: int
    attributes: bool
    via_ctypes: bool
    library: str = ""
    rejects_legacy_stream: bool = True


@dataclass(frozen=True, slots=True)
class VendorTable:
    """One vendor's runtime API, as data (see module docstring).

    Attributes:
        backend: Registered backend name ("cuda", "rocm").
        prefix: Function/constant prefix ("cuda", "hip").
        module: Import path of the Python binding module.
        package: pip requirement that provides `module`, for messages.
        extra: kvhal extra that installs it.
        version_scale: (major, minor) divisors of the vendor's integer version encoding.
        batch: Batch-copy quirks.
        overrides: Operation or constant -> vendor name, where the vendor does not follow
            prefix + CUDA suffix.
    """

    backend: str
    prefix: str
    module: str
    package: str
    extra: str
    version_scale: tuple[int, int]
    batch: BatchQuirks
    overrides: dict[str, str] = field(default_factory=dict)

    def api(self, op: str) -> str:
        """Vendor function name of operation `op` (a key of `OPERATIONS`)."""
        return self.overrides.get(op) or self.prefix + OPERATIONS[op]

    def constant(self, key: str) -> str:
        """Vendor constant name of `key` (a key of `CONSTANTS`)."""
        return self.overrides.get(key) or self.prefix + CONSTANTS[key]

    def error_enum(self) -> str:
        """Name of the vendor's error enum in `module` (`cudaError_t`, `hipError_t`)."""
        return self.prefix + "Error_t"

    def memcpy_kind(self) -> tuple[str, str]:
        """(enum name, member name) of the 'infer direction from the addresses' copy kind."""
        return self.prefix + "MemcpyKind", self.prefix + "MemcpyDefault"

    def version_text(self, version: int) -> str:
        """Human form of an encoded runtime/driver version (0 -> 'none')."""
        if version <= 0:
            return "none"
        major_div, minor_div = self.version_scale
        return f"{version // major_div}.{version % major_div // minor_div}"
