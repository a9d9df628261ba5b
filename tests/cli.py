"""Running `kvhal` as a user does (a separate `python -m kvhal.cli` process), timed by the
test's own clocks, and the test's own memcpy to hold a bench's figures against."""
from __future__ import annotations

import resource
import subprocess
import sys
import time

import numpy as np


def kvhal(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m kvhal.cli *args` with text stdout and stderr captured.

    Raises:
        subprocess.TimeoutExpired: it ran longer than `timeout` seconds.
    """
    return subprocess.run([sys.executable, "-m", "kvhal.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def timed_kvhal(*args: str) -> tuple[subprocess.CompletedProcess, float, float]:
    """`kvhal(*args)`, the wall seconds it took and the CPU seconds (user + system) of the
    command and the children it waited for, by this process's own clocks."""
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    out = kvhal(*args)
    wall_s = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return out, wall_s, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def memcpy_gbps(nbytes: int, repeats: int = 5) -> float:
    """GB/s (1e9 B/s) of this process's best of `repeats` numpy copies of `nbytes` bytes
    between two page-faulted buffers: an upper bound no copy of those bytes through a
    benchmark's loops (a backend's copies, a socket) beats by much."""
    src, dst = np.ones(nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9
