"""A local S3-compatible server for benchmarks and tests: `moto_server` (PyPI `moto[server]`,
the `dev` extra) as a separate process on a free 127.0.0.1 port.

moto keeps objects in the server process's memory: a server that is killed loses its
buckets. The child gets SIGKILL when the process that started it dies (Linux
`PR_SET_PDEATHSIG`), so no server outlives a crashed test run.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from kvhal.procs import LocalService, die_with_parent, free_port

#: Seconds to wait for a fresh server to answer.
START_TIMEOUT_S = 60.0


class LocalS3Server(LocalService):
    """One `moto_server` process.

    Args:
        port: TCP port on 127.0.0.1 (default: a free one).
        env: Extra environment of the server (e.g. moto's `INITIAL_NO_AUTH_ACTION_COUNT`).

    Attributes:
        endpoint: "http://127.0.0.1:<port>".
    """

    def __init__(self, port: int | None = None, env: dict[str, str] | None = None):
        self._fixed_port = port is not None
        self.port = port or free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._env = dict(os.environ, **(env or {}))
        self._proc: subprocess.Popen | None = None

    def start(self) -> "LocalS3Server":
        """Start the server and wait until it answers. A free port taken by another program
        between choosing and binding it is replaced by a new one (up to 5 times).

        Raises:
            RuntimeError: moto is not installed, or the server did not answer within
                `START_TIMEOUT_S` (its output is in the message).
        """
        for _ in range(4):
            try:
                return self._start_once()
            except RuntimeError as exc:
                if self._fixed_port or "Address already in use" not in str(exc):
                    raise
                self.port = free_port()
                self.endpoint = f"http://127.0.0.1:{self.port}"
        return self._start_once()

    def _start_once(self) -> "LocalS3Server":
        try:
            import moto.server  # noqa: F401
        except ImportError as exc:
            raise RuntimeError(f"the local S3 server needs moto[server] (the dev extra): "
                               f"{exc}") from None
        self._log = tempfile.TemporaryFile()  # moto logs every request: never a full pipe
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=self._log, env=self._env,
            preexec_fn=die_with_parent)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self._log.seek(0)
                raise RuntimeError(f"moto_server exited with {self._proc.returncode}: "
                                   f"{self._log.read().decode(errors='replace')[-500:]}")
            try:
                urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=1).close()
                return self
            except (urllib.error.URLError, OSError):
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"moto_server on port {self.port} did not answer within "
                           f"{START_TIMEOUT_S} s")

    def create_bucket(self, bucket: str) -> None:
        """Create `bucket` (an unsigned PUT: moto does not check signatures by default)."""
        request = urllib.request.Request(f"{self.endpoint}/{bucket}", data=b"", method="PUT")
        urllib.request.urlopen(request, timeout=30).close()

    stop = LocalService.kill

    def __enter__(self) -> "LocalS3Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()
