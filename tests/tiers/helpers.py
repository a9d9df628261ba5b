"""Shared helpers of the tier tests: an aligned host region, keys, payloads, one-job runs,
polling a condition with a deadline."""
from __future__ import annotations

import glob
import mmap
import os
import subprocess
import threading
import time
from typing import Callable

import numpy as np

from conformance.tier_fixtures import chunk_key, load, payload, run_jobs, store  # noqa: F401

NAMESPACE = bytes(range(16))
OTHER_NAMESPACE = bytes(range(16, 32))


class PassThroughOs:
    """The real `os` module behind another object: `fileio` then takes its Python path (one
    system call per step), the reference the C path is compared with. Injects nothing."""

    def __getattr__(self, name):
        return getattr(os, name)


class FaultyPausedOs(PassThroughOs):
    """`os`, except that the first call of `method` ("preadv" or "pwritev") sets `paused` and
    waits for `resume`: holds one read or write of a tier in flight on demand, which a real
    disk cannot do. Every other call goes straight through."""

    def __init__(self, method: str):
        self.paused, self.resume = threading.Event(), threading.Event()
        self._method = method

    def __getattr__(self, name):
        real = getattr(os, name)
        if name != self._method:
            return real

        def paused_call(*args):
            if not self.paused.is_set():
                self.paused.set()
                assert self.resume.wait(30)
            return real(*args)
        return paused_call


def host_region(nbytes: int = 8 << 20) -> tuple[memoryview, np.ndarray]:
    """A page-aligned anonymous host region and its uint8 numpy view."""
    view = memoryview(mmap.mmap(-1, nbytes))
    return view, np.frombuffer(view, dtype=np.uint8)


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def wait_for(condition: Callable[[], bool], timeout_s: float = 20.0, what: str = "") -> None:
    """Poll `condition` every 10 ms until true. Raises AssertionError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what or condition}")
        time.sleep(0.01)


def temp_files(ns_dir: str) -> list[str]:
    """Temp files (`*.tmp`) in the chunk folders of the namespace folder `ns_dir`, sorted."""
    return sorted(glob.glob(os.path.join(ns_dir, "chunks", "*", "*.tmp")))


def kv_bytes(ns_dir: str) -> int:
    """Bytes of the chunk files (`*.kv`) in the chunk folders of the namespace folder `ns_dir`
    now (files that vanish while listed are skipped)."""
    total = 0
    for path in glob.glob(os.path.join(ns_dir, "chunks", "*", "*.kv")):
        try:
            total += os.stat(path).st_size
        except FileNotFoundError:
            pass
    return total
