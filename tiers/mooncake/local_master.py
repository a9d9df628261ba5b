"""A local Mooncake pool for benchmarks and tests: `mooncake_master` (from the `mooncake`
extra's wheel) as a separate process on free 127.0.0.1 ports, with its HTTP metadata server.

The master keeps object metadata in memory: a master that is killed loses every object (a
restarted one starts empty; clients reconnect by themselves). The child gets SIGKILL when the
process that started it dies (Linux `PR_SET_PDEATHSIG`).
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from kvhal.procs import LocalService, die_with_parent, free_port, listens

#: Seconds to wait for a fresh master to accept connections.
START_TIMEOUT_S = 30.0
#: Starts tried on fresh ports when a master or keeper exits at once or finds a port of its
#: taken (`_await_serving`).
START_TRIES = 3


class _NotServing(RuntimeError):
    """The process exited before it listened, or another process holds one of its ports."""


def master_binary() -> str | None:
    """Path of `mooncake_master` (next to this Python, else on PATH), or None."""
    beside = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    return beside if os.access(beside, os.X_OK) else shutil.which("mooncake_master")


class LocalMaster(LocalService):
    """One `mooncake_master` process; `start` again after `kill` reuses the same ports.

    Args:
        flags: Extra master flags, e.g. {"default_kv_lease_ttl": "100"}.
        log_path: File its output is appended to, every start's (after a "== start" line);
            None: a temporary file, gone with it.

    Attributes:
        rpc_port, metadata_port, metrics_port: Its 127.0.0.1 ports.
    """

    def __init__(self, flags: dict[str, str] | None = None, log_path: str | None = None):
        self.rpc_port, self.metadata_port, self.metrics_port = (free_port(), free_port(),
                                                                free_port())
        self._flags = dict(flags or {})
        self._log_path = log_path
        self._proc: subprocess.Popen | None = None
        self._log = None
        self._started = False

    def tier_config(self, **extra: Any) -> dict[str, Any]:
        """A mooncake tier config joining this pool over TCP on loopback (16 MiB segment)."""
        return {"type": "mooncake", "master_server_address": f"127.0.0.1:{self.rpc_port}",
                "metadata_server": f"http://127.0.0.1:{self.metadata_port}/metadata",
                "local_hostname": "127.0.0.1", "protocol": "tcp",
                "global_segment_size": 16 << 20, "local_buffer_size": 16 << 20} | extra

    def start(self) -> "LocalMaster":
        """Start the master and wait until its RPC and metadata ports accept connections. On
        the first start, a master that exits at once (a port taken between drawing and binding:
        another worker's Mooncake client binds ports in the same range) is started again on
        new ports, up to `START_TRIES` times in all; a restart keeps its ports.

        Raises:
            RuntimeError: no `mooncake_master` binary, or it did not listen within
                `START_TIMEOUT_S` (its output is in the message).
        """
        binary = master_binary()
        if binary is None:
            raise RuntimeError("mooncake_master not found: pip install 'kvhal[mooncake]'")
        for attempt in range(1 if self._started else START_TRIES):
            if attempt:
                self.rpc_port, self.metadata_port, self.metrics_port = (
                    free_port(), free_port(), free_port())
            try:
                self._start_once(binary)
                self._started = True
                return self
            except _NotServing as exc:
                failure = exc
                self.kill()   # reaps it and closes its log
        raise RuntimeError(str(failure))

    def _start_once(self, binary: str) -> None:
        flags = {"rpc_port": str(self.rpc_port), "rpc_address": "127.0.0.1",
                 "enable_http_metadata_server": "true",
                 "http_metadata_server_host": "127.0.0.1",
                 "http_metadata_server_port": str(self.metadata_port),
                 "metrics_port": str(self.metrics_port), "metrics_host": "127.0.0.1",
                 "rpc_thread_num": "2"} | self._flags
        if self._log_path is None:
            self._log = tempfile.TemporaryFile()
        else:
            self._log = open(self._log_path, "ab+")
            self._log.write(f"== start {time.strftime('%H:%M:%S')} on ports {self.rpc_port}, "
                            f"{self.metadata_port}, {self.metrics_port}\n".encode())
            self._log.flush()
        self._proc = subprocess.Popen([binary] + [f"-{k}={v}" for k, v in flags.items()],
                                      stdout=self._log, stderr=subprocess.STDOUT,
                                      preexec_fn=die_with_parent)
        try:
            _await_serving(self._proc, (self.rpc_port, self.metadata_port), "mooncake_master")
        except _NotServing as exc:
            self._log.seek(0)   # (appended: the tail is this start's)
            tail = self._log.read().decode(errors="replace")[-800:].strip()
            raise _NotServing(f"{exc}: {tail}" if tail else str(exc)) from None
        except RuntimeError:
            self.kill()
            raise

    def __enter__(self) -> "LocalMaster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()


def _await_serving(proc: subprocess.Popen, ports: tuple[int, ...], what: str) -> None:
    """Wait until `proc` itself listens on every port of `ports`.

    Raises:
        _NotServing: it exited, or another process answers on one of its ports (a port taken
            between drawing and binding: Mooncake's master then binds nothing, logs nothing
            and runs on).
        RuntimeError: neither within `START_TIMEOUT_S`.
    """
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise _NotServing(f"{what} exited with {proc.returncode}")
        if all(_serves(proc.pid, p) for p in ports):
            return
        # someone answers first, and the process still does not hold the port after: taken
        # (asked the other way round, a bind between the two questions looks like one)
        taken = [p for p in ports if _listening(p) and listens(proc.pid, p) is False]
        if taken:
            raise _NotServing(f"{what}: another process holds its port {taken[0]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not listen on {', '.join(map(str, ports))} "
                               f"within {START_TIMEOUT_S} s")
        time.sleep(0.02)


def _serves(pid: int, port: int) -> bool:
    """Whether process `pid` listens on `port` (`listens`; where /proc cannot tell, whether
    anything answers there)."""
    own = listens(pid, port)
    return _listening(port) if own is None else own


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


class SegmentKeeper(LocalService):
    """A `mooncake_client` process lending `segment_bytes` of memory to a pool: chunks stored
    by clients that lend none (`global_segment_size` 0) land there and outlive them. `kill`
    SIGKILLs it: the pool loses its segment's objects.

    Args:
        master: The pool's master (running).
        segment_bytes: Memory lent, bytes.
    """

    def __init__(self, master: LocalMaster, segment_bytes: int):
        self.port = free_port()
        self._args = [f"-master_server_address=127.0.0.1:{master.rpc_port}",
                      f"-metadata_server=http://127.0.0.1:{master.metadata_port}/metadata",
                      "-host=127.0.0.1", "-protocol=tcp",
                      f"-global_segment_size={segment_bytes}"]
        self._proc: subprocess.Popen | None = None

    def start(self) -> "SegmentKeeper":
        """Start the client and wait until it serves (its segment is mounted by then); one
        that exits at once, or finds its port held by another process, is started again on a
        new port, up to `START_TRIES` times in all.

        Raises:
            RuntimeError: no `mooncake_client` binary, or it did not serve within
                `START_TIMEOUT_S`, or not on any of the ports tried.
        """
        binary = os.path.join(os.path.dirname(master_binary() or ""), "mooncake_client")
        if not os.access(binary, os.X_OK):
            raise RuntimeError("mooncake_client not found: pip install 'kvhal[mooncake]'")
        for attempt in range(START_TRIES):
            if attempt:
                self.port = free_port()
            self._proc = subprocess.Popen([binary, *self._args, f"-port={self.port}"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          preexec_fn=die_with_parent)
            try:
                _await_serving(self._proc, (self.port,), "mooncake_client")
                return self
            except _NotServing as exc:
                failure = exc
                self.kill()
            except RuntimeError:
                self.kill()
                raise
        raise RuntimeError(f"{failure} ({START_TRIES} ports tried)")
