"""The cuda backend."""
from .backend import CudaBackend

__all__ = ["CudaBackend"]
