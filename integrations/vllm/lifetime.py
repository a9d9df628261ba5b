"""Tie the engine-core process's life to vLLM's API server, so a killed server frees kvhal's
host region.

vLLM 0.32's engine core does not notice its API server dying (measured: after `kill -9` of the
API server, `VLLM::EngineCore` and its workers kept running under init, holding the whole KV
cache and kvhal's host region). Its workers already follow the engine core (vLLM's death pipe,
`v1/executor/multiproc_executor.py`). `exit_with_parent` closes the remaining gap with Linux's
`PR_SET_PDEATHSIG` (prctl(2)): the kernel sends SIGTERM when the parent dies, and vLLM's SIGTERM
handler shuts the engine down (connector shutdown included). `on_shutdown_signal` lets the
connector close its tiers as soon as that shutdown begins (at TP > 1 vLLM kills the engine core
before the connector's own `shutdown` runs).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

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


def on_shutdown_signal(callback: Callable[[], None]) -> bool:
    """Call `callback()` (then the handler that was there) when this process gets SIGTERM or
    SIGINT, in vLLM's engine-core process only.

    Why: vLLM 0.32's engine core, told to stop, leaves its busy loop once nothing is left to
    do (`EngineCore._handle_shutdown`; kvhal's jobs count, `has_pending_push_work`), then
    shuts its executor down *before* its scheduler (`EngineCore.shutdown`): at TP > 1 the
    workers ignore the request, the executor waits 5 s for them, and the process manager
    kills the engine core (its 5 s budget) before `Scheduler.shutdown` reaches the
    connector's `shutdown`. vLLM has no connector hook at the start of a shutdown; its SIGTERM
    and SIGINT handlers (set in `run_engine_core` before the engine, so before the connector,
    is built) are where it starts, so kvhal chains its own there: the connector then closes
    its tiers while the busy loop still runs (`SchedulerSide.has_pending_push_work`).

    Only acts in a process started by `multiprocessing` whose handler for both signals is a
    Python function (vLLM's), on its main thread; anywhere else (an engine in the caller's
    own process) the caller's handlers are left alone.

    Returns:
        True if the hook was chained, False where it was left alone.
    """
    if (multiprocessing.parent_process() is None
            or threading.current_thread() is not threading.main_thread()):
        return False
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    if not all(callable(h) and h is not signal.default_int_handler for h in previous.values()):
        return False

    def chained(signum: int, frame: Any) -> None:
        callback()
        previous[signal.Signals(signum)](signum, frame)

    for sig in previous:
        signal.signal(sig, chained)
    return True
