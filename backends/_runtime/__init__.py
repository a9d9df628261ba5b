"""The runtime-API adapter shared by the cuda and rocm backends (DESIGN §2)."""
from .backend import RuntimeBackend
from .batch import BatchMode, chunk_bounds, select_batch_mode, uses_native
from .errors import Errors
from .interop import tensor_allocation, tensor_device, tensor_span
from .probe import probe
from ..validate import batch_arrays, copy_2d_args, copy_args, host_range
from .vendor import BatchQuirks, VendorTable

__all__ = ["BatchMode", "BatchQuirks", "Errors", "RuntimeBackend", "VendorTable", "batch_arrays",
           "chunk_bounds", "copy_2d_args", "copy_args", "host_range", "probe", "select_batch_mode",
           "tensor_allocation", "tensor_device", "tensor_span", "uses_native"]
