"""The soak's processes: a small filesystem for the fs tier, `moto_server`, the keep-everything
reference server and the two kvhal servers, each a real `vllm.entrypoints.openai.api_server`
(`ServerProcess`) at `--max-num-seqs 1`.

The fs tier lives on a tmpfs of `FS_BYTES` mounted for the run (root only; elsewhere a plain
folder, and `fs_full` is skipped). Both kvhal servers share its folder and one bucket, so a
conversation moving between them finds its KV there.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil

from ..vllm.engine import engine_env, kv_transfer_config
from ..vllm.server import ServerProcess, free_port, kv_events_config, server_argv

#: Size of the fs tier's filesystem, and the fs tier's byte budget within it.
FS_BYTES = 48 << 20
FS_BUDGET = 32 << 20
#: kvhal's host tier per server: 48 chunks of the tiny model, twice vLLM's own cache (so it serves
#: what vLLM evicted); the rest spills to fs and S3.
HOST_BYTES = 12 << 20
#: vLLM's own KV cache blocks per kvhal server (128 tokens each): small, so vLLM evicts and
#: kvhal serves.
NUM_BLOCKS = 24
#: Longest prompt + answer (the soak's conversations stay under 1,000 tokens).
MAX_MODEL_LEN = 2048
#: Seconds vLLM may drain at SIGTERM (`--shutdown-timeout`).
SHUTDOWN_S = 10
BUCKET = "soak"
#: moto's static test credentials (any pair works with moto).
S3_KEYS = {"access_key": "soak", "secret_key": "soak"}


def mount_small_fs(folder: Path) -> bool:
    """Mount a tmpfs of `FS_BYTES` on `folder` (made if absent); False when this process may
    not mount (then `folder` is a plain folder)."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES}", "tmpfs",
                          str(folder)], capture_output=True, text=True, check=False)
    return out.returncode == 0


def unmount(folder: Path) -> None:
    """Unmount the tmpfs on `folder` (its files go with it)."""
    subprocess.run(["umount", str(folder)], capture_output=True, check=False)


def kvhal_config(fs_root: Path, s3_endpoint: str | None) -> dict:
    """The kvhal servers' `kv_connector_extra_config`: host, fs (budget `FS_BUDGET`) and, with
    an endpoint, the obj tier on `BUCKET`."""
    tiers: list[dict] = [{"type": "fs", "root_dir": str(fs_root), "max_bytes": FS_BUDGET}]
    if s3_endpoint is not None:
        tiers.append({"type": "obj", "prefix": "soak", "timeout_s": 5,
                      "store_config": {"bucket": BUCKET, "endpoint_override": s3_endpoint,
                                       "region": "us-east-1"} | S3_KEYS})
    return {"cpu_bytes_to_use": HOST_BYTES, "secondary_tiers": tiers}


class Server:
    """One vLLM OpenAI server of the soak, restartable on the same port and settings.

    Args:
        name: "reference", "kvhal0", "kvhal1" (names its log files).
        model: Model folder.
        workdir: Folder of its logs.
        config: kvhal's config, or None for the keep-everything reference.
    """

    def __init__(self, name: str, model: Path, workdir: Path, config: dict | None):
        self.name, self.model, self.workdir, self.config = name, model, workdir, config
        self.port = free_port()
        #: Where a kvhal server publishes its KV events (ZMQ PUB) and replays them (ROUTER).
        self.events_port, self.replay_port = free_port(), free_port()
        self.starts = 0
        self.proc: ServerProcess | None = None

    @property
    def url(self) -> str:
        """"http://127.0.0.1:<port>"."""
        return f"http://127.0.0.1:{self.port}"

    def start(self, wait: bool = True) -> None:
        """Start it and (with `wait`) wait for `/health` (raises `ServerDidNotStart`)."""
        extra = ["--max-num-seqs", "1", "--shutdown-timeout", str(SHUTDOWN_S)]
        if self.config is not None:
            extra += ["--kv-events-config",
                      json.dumps(kv_events_config(self.events_port, self.replay_port))]
        argv = server_argv(self.model, self.port, max_model_len=MAX_MODEL_LEN, extra=extra,
                           num_blocks=None if self.config is None else NUM_BLOCKS,
                           kv_transfer_config=None if self.config is None
                           else kv_transfer_config(self.config))
        self.starts += 1
        env = {**os.environ, **engine_env(1, in_process=False)}
        self.proc = ServerProcess(argv, self.port,
                                  self.workdir / f"{self.name}.{self.starts}.log", env)
        if wait:
            self.proc.wait_ready()

    def processes(self) -> list[psutil.Process]:
        """Its live processes (API server, engine core)."""
        return [] if self.proc is None else self.proc.processes()

    def kill(self) -> None:
        """SIGKILL its whole process tree."""
        if self.proc is not None:
            self.proc.stop_all()

    def signal_all(self, sig: signal.Signals) -> None:
        """Send `sig` to each of its processes."""
        for p in self.processes():
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass

    def stop(self, timeout_s: float = 120.0) -> list[int]:
        """SIGTERM its API server (a clean shutdown) and wait; the pids left after
        `timeout_s` (then killed)."""
        if self.proc is None:
            return []
        procs = self.processes()
        try:
            self.proc.api_server().send_signal(signal.SIGTERM)
        except (psutil.NoSuchProcess, StopIteration):   # it died: nothing to stop cleanly
            pass
        _, left = psutil.wait_procs(procs, timeout=timeout_s)
        self.proc.stop_all()
        return [p.pid for p in left]


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Wait until none of `pids` runs; those still running after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return [p for p in pids if psutil.pid_exists(p)]
