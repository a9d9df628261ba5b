"""vLLM's OpenAI server started from the README's own command line, for the server tests.

`readme_block(marker)` returns the bash block that follows `<!-- marker ... -->` in README.md,
so the tests run exactly what the README shows. `Server` runs it in its own session with the
environment the README names (`MODEL`, `PORT`, `KVHAL_ROOT`) plus this machine's needs
(offline hub, a 1 GiB vLLM-CPU KV cache).
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import psutil

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_block(marker: str) -> str:
    """The ```bash block right after the HTML comment starting with `<!-- marker`."""
    text = README.read_text()
    m = re.search(r"<!-- " + re.escape(marker) + r"[^>]*-->\n```bash\n(.*?)\n```", text, re.S)
    if m is None:
        raise LookupError(f"README.md has no bash block after '<!-- {marker}'")
    return m.group(1)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """The README's server command line, running (see the module docstring).

    Args:
        model: Model folder (`MODEL`).
        root: fs tier folder (`KVHAL_ROOT`).
        log: File receiving the server's stdout and stderr.
        timeout_s: Seconds `wait_ready` waits for `/health`.
        block: The README block to run (after `<!-- block`).
        env: More environment variables the block reads.
    """

    def __init__(self, model: Path, root: Path, log: Path, timeout_s: float = 400.0, *,
                 block: str = "server command", env: dict[str, str] | None = None):
        self.port = free_port()
        self.env = {**os.environ, "MODEL": str(model), "PORT": str(self.port),
                    "KVHAL_ROOT": str(root), "HF_HUB_OFFLINE": "1",
                    "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
        self.env.pop("PYTHONHASHSEED", None)         # vLLM's defaults, as a new user has them
        self.log = log
        self._log = log.open("w")
        self._seen: dict[int, psutil.Process] = {}
        self.proc = subprocess.Popen(["bash", "-c", readme_block(block)],
                                     env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.timeout_s = timeout_s

    def wait_ready(self) -> None:
        """Block until `/health` answers (servers started side by side start in parallel).

        Raises:
            RuntimeError: the server exited or did not answer within `timeout_s`.
        """
        deadline = time.monotonic() + self.timeout_s
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop_all()
                raise RuntimeError(f"server did not come up: {self.log.read_text()[-3000:]}")
            time.sleep(0.5)

    def _healthy(self) -> bool:
        try:
            out = subprocess.run(["curl", "-sf", f"localhost:{self.port}/health"],
                                 capture_output=True, timeout=10)
        except subprocess.TimeoutExpired:
            return False
        return out.returncode == 0

    def client_call(self) -> dict:
        """Run the README's client call; return the decoded answer."""
        out = subprocess.run(["bash", "-c", readme_block("client call")], env=self.env,
                             capture_output=True, text=True, timeout=300, check=True)
        return json.loads(out.stdout)

    def processes(self) -> list[psutil.Process]:
        """The server's process tree now: bash (or the API server it became) and descendants."""
        try:
            root = psutil.Process(self.proc.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
        self._seen.update((p.pid, p) for p in tree)
        return tree

    def api_server(self) -> psutil.Process:
        """The API server process (the one running the `api_server` module)."""
        return next(p for p in self.processes()
                    if "vllm.entrypoints.openai.api_server" in " ".join(p.cmdline()))

    def stop_all(self) -> None:
        """SIGKILL whatever is left of this server's session (teardown)."""
        self.processes()
        for proc in self._seen.values():
            try:
                if proc.is_running():
                    proc.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait(60)
        self._log.close()
