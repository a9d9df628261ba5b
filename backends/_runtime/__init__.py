"""The runtime-API adapter shared by the cuda and rocm backends (DESIGN §2)."""
from .backend import RuntimeBackend, check_2d
from .batch import BatchMode, chunk_bounds, select_batch_mode, uses_native
from .errors import Errors
from .probe import probe
from .vendor import BatchQuirks, VendorTable

__all__ = ["BatchMode", "BatchQuirks", "Errors", "RuntimeBackend", "VendorTable", "check_2d",
           "chunk_bounds", "probe", "select_batch_mode", "uses_native"]
