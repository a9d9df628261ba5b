"""The CUDA runtime as a vendor table (cuda-python `cuda.bindings.runtime`, 12.8–13.x)."""
from kvhal.backends._runtime.vendor import BatchQuirks, VendorTable

#: Version encoding: major * 1000 + minor * 10 (`cudaRuntimeGetVersion`, 13.4 = 13040).
CUDA = VendorTable(
    backend="cuda", prefix="cuda", module="cuda.bindings.runtime",
    package="cuda-python (cuda.bindings.runtime)", extra="cuda", version_scale=(1000, 10),
    batch=BatchQuirks(
        min_runtime=12080,       # cudaMemcpyBatchAsync first appears in CUDA 12.8
        fail_idx_below=13000,    # 12.8/12.9 take a failIdx out-argument; 13.0 dropped it
        max_descriptors=8192,    # no documented limit; bounds the per-call list conversion
        attributes=True,         # every copy needs an attribute set: numAttrs = 1
        via_ctypes=False),       # cuda-python's wrapper takes lists of addresses
)
