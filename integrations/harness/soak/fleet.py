"""The soak's processes: a small filesystem for the fs tier, `moto_server`, `mooncake_master`
(where installed), the keep-everything reference server and the two kvhal servers, each a real
`vllm.entrypoints.openai.api_server` (`ServerProcess`) at `--max-num-seqs 1`.

The fs tier lives on a tmpfs of `FS_BYTES` mounted for the run (root only; elsewhere a plain
folder, and `fs_full` is skipped). Both kvhal servers share its folder, one bucket and one
Mooncake pool, so a conversation moving between them finds its KV there; each also follows the
other's host tier over p2p (`peers`, one shared key file). Every service keeps its ports across
restarts (the servers' configs name them).
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import time
from pathlib import Path

import psutil

from kvhal.procs import bindable

from ..vllm.engine import engine_env, kv_transfer_config
from ..vllm.serve_metrics import parse
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
#: Deadline of every p2p and obj call (s): a stopped or killed peer costs at most this.
TIER_TIMEOUT_S = 3
#: Seconds a restarted service may take to bind its old port again (another process may hold
#: a connection end on it a little while).
REBIND_S = 30.0


def mount_small_fs(folder: Path) -> bool:
    """Mount a tmpfs of `FS_BYTES` on `folder` (made if absent); False when this process may
    not mount (then `folder` is a plain folder)."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES}", "tmpfs",
                          str(folder)], capture_output=True, text=True, check=False)
    return out.returncode == 0


def unmount(folder: Path, timeout_s: float = 10.0) -> list[str]:
    """Unmount the tmpfs on `folder` (its files go with it), waiting up to `timeout_s` for
    processes still dying to let go of it; then detach it lazily (`umount -l`: gone from the
    namespace now, freed when its last user closes it). Returns the processes that held it
    at the lazy detach ("pid name"), [] when a plain unmount worked. The caller checks
    `os.path.ismount(folder)` after it.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if subprocess.run(["umount", str(folder)], capture_output=True,
                          check=False).returncode == 0 or not os.path.ismount(folder):
            return []
        if time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    holders = _holders(folder)
    subprocess.run(["umount", "-l", str(folder)], capture_output=True, check=False)
    return holders


def _holders(folder: Path) -> list[str]:
    """The processes with a file, cwd or mapping under `folder`."""
    prefix = str(folder.resolve()) + os.sep
    out = []
    for p in psutil.process_iter(["pid", "name"]):
        try:
            paths = [f.path for f in p.open_files()] + [p.cwd()]
            paths += [m.path for m in p.memory_maps()]
        except (psutil.Error, OSError):
            continue
        if any(x.startswith(prefix) for x in paths):
            out.append(f"{p.info['pid']} {p.info['name']}")
    return out


def kvhal_config(fs_root: Path, s3_endpoint: str | None, p2p_ports: list[int] | None = None,
                 index: int = 0, key_file: Path | None = None,
                 mooncake: dict | None = None) -> dict:
    """Kvhal server `index`'s `kv_connector_extra_config`: host, with `p2p_ports` a p2p tier
    listening on `p2p_ports[index]` and following the others (`peers`, key in `key_file`;
    first, so a chunk the other server's host tier holds is pulled from it), fs (budget
    `FS_BUDGET`), with `mooncake` that tier config, and with an endpoint the obj tier on
    `BUCKET`. A miss asks the secondary tiers in this order."""
    tiers: list[dict] = []
    if p2p_ports is not None:
        tiers.append({"type": "p2p", "host": "127.0.0.1", "port": p2p_ports[index],
                      "peers": [f"127.0.0.1:{p}" for j, p in enumerate(p2p_ports)
                                if j != index],
                      "timeout_s": TIER_TIMEOUT_S, "auth_key_file": str(key_file)})
    tiers.append({"type": "fs", "root_dir": str(fs_root), "max_bytes": FS_BUDGET})
    if mooncake is not None:
        tiers.append(mooncake)
    if s3_endpoint is not None:
        tiers.append({"type": "obj", "prefix": "soak", "timeout_s": TIER_TIMEOUT_S,
                      "store_config": {"bucket": BUCKET, "endpoint_override": s3_endpoint,
                                       "region": "us-east-1"} | S3_KEYS})
    return {"cpu_bytes_to_use": HOST_BYTES, "secondary_tiers": tiers}


def p2p_key(workdir: Path) -> Path:
    """A fresh shared p2p key in `workdir/p2p.key` (mode 0600); its path."""
    path = workdir / "p2p.key"
    path.write_text(secrets.token_urlsafe(24))
    path.chmod(0o600)
    return path


def start_s3():
    """A `moto_server` on a fixed port (restarts keep it: the servers' configs name it) with
    `BUCKET`; None where moto or obstore is missing."""
    from kvhal.tiers.obj.local_server import LocalS3Server
    try:
        import obstore  # noqa: F401
    except ImportError:
        return None
    for _ in range(3):      # a drawn port another process took before moto bound it
        try:
            s3 = LocalS3Server(port=free_port()).start()
        except (RuntimeError, OSError):
            continue
        s3.create_bucket(BUCKET)
        return s3
    return None


def start_mooncake(log_path: Path | None = None):
    """A `mooncake_master` (restarts keep its ports; every start's output appended to
    `log_path`), or (None, why) where Mooncake is not installed or does not start here."""
    from kvhal.tiers.mooncake.client import store_class
    from kvhal.tiers.mooncake.local_master import LocalMaster, master_binary

    from kvhal.tier import TierError
    try:
        store_class()
    except TierError as e:
        return None, str(e)[:300]
    if master_binary() is None:
        return None, "mooncake_master not found: pip install 'kvhal[mooncake]'"
    try:
        return LocalMaster(log_path=None if log_path is None else str(log_path)).start(), None
    except RuntimeError as e:
        return None, str(e)[:300]


def mooncake_tier(master) -> dict:
    """The kvhal servers' mooncake tier on `master`'s pool (each lends 16 MiB), listing the
    pool every second so evictions and a master restart reach the index in seconds."""
    return master.tier_config(
        master_metrics_address=f"127.0.0.1:{master.metrics_port}", list_interval_s=1.0)


def restart_same_port(service, port: int) -> None:
    """SIGKILL `service` (a `LocalService`: moto_server, mooncake_master) and start it again on
    `port`, retried until `REBIND_S` while the port is still held.

    Raises:
        RuntimeError: it did not start on `port` within `REBIND_S` (the last error).
    """
    service.kill()
    deadline = time.monotonic() + REBIND_S
    while True:
        try:
            service.start()
            return
        except RuntimeError as e:
            service.kill()
            if time.monotonic() > deadline:
                raise RuntimeError(f"restart on port {port}: {e}") from None
            while not bindable(port) and time.monotonic() < deadline:
                time.sleep(0.2)


class Server:
    """One vLLM OpenAI server of the soak, restartable on the same port and settings.

    Args:
        name: "reference", "kvhal0", "kvhal1" (names its log files).
        model: Model folder.
        workdir: Folder of its logs.
        config: kvhal's config, or None for the keep-everything reference.
        core: The CPU its model computes on (`VLLM_CPU_OMP_THREADS_BIND`; every server
            computes with one OpenMP thread, so the numerics do not depend on it), or None for
            vLLM's choice (core 0 for every server). Not with `tp` > 1 (one core per rank).
        tp: `--tensor-parallel-size`.
        events: Whether a kvhal server publishes KV events (on `events_port`).
        max_model_len: vLLM's `--max-model-len` (tokens).
        num_blocks: vLLM's KV cache blocks of a kvhal server (the reference keeps vLLM's).
        shutdown_s: vLLM's `--shutdown-timeout` (seconds it may drain at SIGTERM).
    """

    def __init__(self, name: str, model: Path, workdir: Path, config: dict | None,
                 core: int | None = None, tp: int = 1, events: bool = True,
                 max_model_len: int = MAX_MODEL_LEN, num_blocks: int = NUM_BLOCKS,
                 shutdown_s: float = SHUTDOWN_S):
        self.name, self.model, self.workdir, self.config = name, model, workdir, config
        self.tp, self.events = tp, events
        self.max_model_len, self.num_blocks, self.shutdown_s = (max_model_len, num_blocks,
                                                                shutdown_s)
        self.core = None if core is None or tp > 1 else core % (os.cpu_count() or 1)
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
        extra = ["--max-num-seqs", "1", "--shutdown-timeout", f"{self.shutdown_s:g}",
                 "--tensor-parallel-size", str(self.tp)]
        if self.config is not None and self.events:
            extra += ["--kv-events-config",
                      json.dumps(kv_events_config(self.events_port, self.replay_port))]
        argv = server_argv(self.model, self.port, max_model_len=self.max_model_len,
                           extra=extra, num_blocks=None if self.config is None
                           else self.num_blocks,
                           kv_transfer_config=None if self.config is None
                           else kv_transfer_config(self.config))
        self.starts += 1
        env = {**os.environ, **engine_env(self.tp, in_process=False)}
        if self.core is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(self.core)
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


def scrape(url: str) -> dict:
    """A server's `/metrics`, parsed (`serve_metrics.parse`). Raises OSError when it is down."""
    import urllib.request
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        return parse(r.read().decode())
