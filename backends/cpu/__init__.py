"""The cpu reference backend (DESIGN §2)."""
from .backend import CHAOS_ENV, CpuBackend

__all__ = ["CHAOS_ENV", "CpuBackend"]
