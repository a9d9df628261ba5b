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
import os
import random
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


#: Where `free_port` looks, below Linux's ephemeral range (ip_local_port_range(7)).
PORT_FLOOR = 20000
_handed_out: set[int] = set()
#: Its own generator: a test seeding `random` must not make two processes draw alike.
_draw = random.SystemRandom()


def _ephemeral_floor() -> int:
    """First port of the kernel's ephemeral range (outgoing connections and port-0 binds
    take theirs from it); 32768 (Linux's default) where it cannot be read."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, for a server another process will bind.

    Drawn at random below the ephemeral range, never twice by one process: a port the kernel
    hands out for port 0 lies inside it, where any outgoing connection made before the server
    binds (another test worker's, vLLM's own) can take it ("Address already in use", seen in
    CI). Falls back to port 0 where the range leaves no room below it.
    """
    floor = _ephemeral_floor()
    if floor - PORT_FLOOR >= 1000:
        for _ in range(200):
            port = _draw.randrange(PORT_FLOOR, floor)
            if port not in _handed_out and bindable(port):
                _handed_out.add(port)
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bindable(port: int) -> bool:
    """Whether nothing holds `port` on 127.0.0.1 (no listener, no connection end)."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def listens(pid: int, port: int) -> bool | None:
    """Whether process `pid` itself holds a listening TCP socket on `port` (Linux: the LISTEN
    rows of /proc/net/tcp{,6} for that port, matched by inode to the process's open fds);
    None where /proc/net/tcp or the process's fds cannot be read (not Linux, another user's
    process): the caller cannot tell.

    A connection to the port proves less: a service whose bind failed silently (Mooncake's
    master logs nothing) can run while another process holds the port.
    """
    inodes, readable = set(), False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        readable = True
        for row in rows:
            fields = row.split()
            if (len(fields) > 9 and fields[3] == "0A"
                    and int(fields[1].rsplit(":", 1)[1], 16) == port):
                inodes.add(fields[9])
    if not readable:
        return None
    if not inodes:
        return False
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except FileNotFoundError:   # no such process (any more)
        return False
    except OSError:             # not ours to read
        return None
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            return True
    return False


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
