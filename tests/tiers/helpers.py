"""Shared helpers of the fs tier tests: an aligned host region, keys, payloads, one-job runs."""
from __future__ import annotations

import mmap
import subprocess

import numpy as np

from conformance.tier_fixtures import chunk_key, load, payload, store  # noqa: F401

NAMESPACE = bytes(range(16))
OTHER_NAMESPACE = bytes(range(16, 32))


def host_region(nbytes: int = 8 << 20) -> tuple[memoryview, np.ndarray]:
    """A page-aligned anonymous host region and its uint8 numpy view."""
    view = memoryview(mmap.mmap(-1, nbytes))
    return view, np.frombuffer(view, dtype=np.uint8)


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid
