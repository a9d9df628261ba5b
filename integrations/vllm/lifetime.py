"""Tie the engine-core process's life to vLLM's API server, so a killed server frees kvhal's
host region.

vLLM 0.32's engine core does not notice its API server dying (measured: after `kill -9` of the
API server, `VLLM::EngineCore` and its workers kept running under init, holding the whole KV
cache and kvhal's host region). Its workers already follow the engine core (vLLM's death pipe,
`v1/executor/multiproc_executor.py`). `exit_with_parent` closes the remaining gap with Linux's
`PR_SET_PDEATHSIG` (prctl(2)): the kernel sends SIGTERM when the parent dies, and vLLM's SIGTERM
handler shuts the engine down (connector shutdown included).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing
import os
import signal

#: prctl(2) option: signal delivered to this process when its parent dies.
PR_SET_PDEATHSIG = 1


def exit_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send `sig` to this process when its multiprocessing parent dies.

    Only acts in a process started by `multiprocessing` (vLLM's engine core); an engine running
    in the caller's own process is left alone. If the parent is already gone, sends `sig` now.

    Returns:
        True if the death signal was armed, False when this is not a multiprocessing child.

    Raises:
        OSError: prctl failed (errno named).
    """
    parent = multiprocessing.parent_process()
    if parent is None or parent.pid is None:
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    if os.getppid() != parent.pid:  # died before the prctl: the kernel will not tell us
        os.kill(os.getpid(), sig)
    return True
