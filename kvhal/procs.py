"""Child processes that do not outlive the process that started them, and the free loopback
ports they listen on (`free_port`); `LocalService`: the lifecycle a local test service's process shares
(moto_server, mooncake_master).

`die_with_parent` asks Linux to SIGKILL the calling process when its parent thread exits
(`PR_SET_PDEATHSIG`, prctl(2)), so a crashed or killed test run leaves no server or peer
process behind: as a `subprocess.Popen(preexec_fn=...)` hook (between fork and exec) or first
thing in a multiprocessing child. (vLLM's engine core, a
multiprocessing child that must shut down cleanly, uses `integrations.vllm.lifetime` instead.)
"""
from __future__ import annotations

import ctypes
import signal
import socket
import subprocess
from typing import IO, Any

#: prctl(2) option: signal delivered to this process when its parent dies.
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Arm SIGKILL-on-parent-death for the calling (child) process; a no-op where prctl is
    missing (not Linux). Safe between fork and exec: no allocation-heavy work, no raising."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (bound to port 0, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalService:
    """A local service process (`_proc`) writing to a log file (`_log`), both set by the
    subclass's `start`: whether it runs, and SIGKILL-and-reap."""

    _proc: subprocess.Popen | None = None
    _log: IO[Any] | None = None

    @property
    def running(self) -> bool:
        """Whether the service process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the service (whatever it held in memory is lost), reap it and close its
        log. Idempotent."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        if self._proc is not None:
            self._proc.wait()
            if self._log is not None:
                self._log.close()
            self._proc = None
