"""The rocm backend."""
from .backend import RocmBackend

__all__ = ["RocmBackend"]
