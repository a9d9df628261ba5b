"""The HIP runtime as a vendor table (hip-python `hip.hip`, ROCm 7.x)."""
from kvhal.backends._runtime.vendor import BatchQuirks, VendorTable

#: Version encoding: major * 10_000_000 + minor * 100_000 + patch (`HIP_VERSION`).
ROCM = VendorTable(
    backend="rocm", prefix="hip", module="hip:hip", package="hip-python (hip.hip)",
    extra="rocm", version_scale=(10_000_000, 100_000),
    batch=BatchQuirks(
        min_runtime=70_000_000,  # hipMemcpyBatchAsync first appears in ROCm/HIP 7.0
        fail_idx_below=None,     # HIP's signature always has failIdx
        max_descriptors=8192,    # more descriptors per call crashed ROCm 7.2
        attributes=False,        # ROCm 7.2 rejects numAttrs > 0
        via_ctypes=True,         # hip-python's generated wrapper treats the arrays as outputs
        library="libamdhip64.so"),
    overrides={"host_alloc": "hipHostMalloc", "free_host": "hipHostFree",
               "host_alloc_portable": "hipHostMallocPortable"},
)
