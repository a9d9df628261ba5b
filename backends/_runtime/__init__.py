"""The runtime-API adapter shared by the cuda and rocm backends (DESIGN §2)."""
from .backend import RuntimeBackend
from .batch import BatchMode, chunk_bounds, select_batch_mode, uses_native
from .errors import Errors
from .interop import tensor_allocation, tensor_device, tensor_span, torch_stream
from .probe import probe
from .validate import batch_arrays, check_2d
from .vendor import BatchQuirks, VendorTable

__all__ = ["BatchMode", "BatchQuirks", "Errors", "RuntimeBackend", "VendorTable", "batch_arrays",
           "check_2d", "chunk_bounds", "probe", "select_batch_mode", "tensor_allocation",
           "tensor_device", "tensor_span", "torch_stream", "uses_native"]
