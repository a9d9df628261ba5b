"""vLLM's OpenAI server started from the README's own command line, for the server tests.

`readme_block(marker)` returns the bash block that follows `<!-- marker ... -->` in README.md,
so the tests run exactly what the README shows. `Server` runs it (as
`kvhal.integrations.harness.vllm.server.ServerProcess`) with the environment the README names
(`MODEL`, `PORT`, `KVHAL_ROOT`) plus this machine's needs (offline hub, a 1 GiB vLLM-CPU KV
cache).
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Sequence

import msgpack
import zmq

from kvhal.integrations.harness.vllm.server import ServerProcess, free_port

#: Seconds a `/metrics` scrape may take.
SCRAPE_TIMEOUT_S = 30
README = Path(__file__).resolve().parents[2] / "README.md"


def readme_block(marker: str) -> str:
    """The ```bash block right after the HTML comment starting with `<!-- marker`."""
    text = README.read_text()
    m = re.search(r"<!-- " + re.escape(marker) + r"[^>]*-->\n```bash\n(.*?)\n```", text, re.S)
    if m is None:
        raise LookupError(f"README.md has no bash block after '<!-- {marker}'")
    return m.group(1)


def scrape(base: str) -> str:
    """The text of `{base}/metrics` (base: "http://host:port")."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=SCRAPE_TIMEOUT_S) as r:
        return r.read().decode()


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` in Prometheus `text` whose labels include `labels` (0 if
    none)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


class Server(ServerProcess):
    """The README's server command line, running (see the module docstring).

    Args:
        model: Model folder (`MODEL`).
        root: fs tier folder (`KVHAL_ROOT`).
        log: File receiving the server's stdout and stderr.
        timeout_s: Seconds `wait_ready` waits for `/health`.
        marker: The README block to run (default: the server command).
        env: More environment variables the block reads (e.g. `P2P_PORT`).
        args: More vLLM arguments appended to the block's command (e.g. a TP size).
    """

    def __init__(self, model: Path, root: Path, log: Path, timeout_s: float = 400.0,
                 marker: str = "server command", env: dict[str, str] | None = None,
                 args: Sequence[str] = ()):
        port = free_port()
        full = {**os.environ, "MODEL": str(model), "PORT": str(port),
                "KVHAL_ROOT": str(root), "HF_HUB_OFFLINE": "1",
                "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
        full.pop("PYTHONHASHSEED", None)         # vLLM's defaults, as a new user has them
        script = " ".join([readme_block(marker), *map(shlex.quote, args)])
        super().__init__(["bash", "-c", script], port, log, full, timeout_s)
        self.url = self.base_url

    def client_call(self) -> dict:
        """Run the README's client call; return the decoded answer."""
        out = subprocess.run(["bash", "-c", readme_block("client call")], env=self.env,
                             capture_output=True, text=True, timeout=300, check=True)
        return json.loads(out.stdout)


def p2p_key_file(folder: Path) -> Path:
    """A new random p2p `auth_key` in `folder`/p2p.key (`KVHAL_P2P_KEY_FILE` of the README's
    P/D blocks)."""
    key = folder / "p2p.key"
    key.write_text(secrets.token_urlsafe(24))
    return key


def readme_proxy(log: Path, order: str, prefiller: ServerProcess, p2p_port: int,
                 decoder: ServerProcess):
    """The README's "pd proxy command" (`kvhal proxy`, on a free port) in `order` between one
    prefiller, whose p2p tier listens on 127.0.0.1:`p2p_port`, and one decoder; a running
    `tests.pd.servers.ProxyProcess` logging to `log`."""
    from ..pd.servers import ProxyProcess

    return ProxyProcess(
        ["bash", "-c", readme_block("pd proxy command")], log,
        env={**os.environ, "PORT": "0", "ORDER": order, "DECODER": decoder.base_url,
             "PREFILLER": f"{prefiller.base_url},127.0.0.1:{p2p_port}"})


#: Field order of `vllm.distributed.kv_events` (decoding events sent as arrays).
_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                    "kv_cache_spec_sliding_window", "locality", "ownership", "session_id"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx", "locality", "ownership"),
    "AllBlocksCleared": (),
}


def decode_batch(payload: bytes) -> list[dict]:
    """The events of one msgpack `KVEventBatch` as a router decodes them: dicts with a "type"
    key and the fields vLLM sent (it omits fields at their defaults)."""
    return [event if isinstance(event, dict) else
            dict(zip(_FIELDS[event[0]], event[1:]), type=event[0])
            for event in msgpack.unpackb(payload, raw=False)[1]]


class Subscriber(threading.Thread):
    """A router's side: binds a ZMQ SUB socket (vLLM's publisher connects to a non-wildcard
    endpoint) and keeps receiving, as libzmq sends the subscription only while the socket is
    used; decodes vLLM's msgpack batches into `events` (dicts with a "type" key and
    "received_at", this host's `time.time()` when the batch arrived)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.events: list[dict] = []
        self._done = threading.Event()
        self._ready = threading.Event()
        self.start()
        self._ready.wait(10)

    def run(self) -> None:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        self.endpoint = f"tcp://127.0.0.1:{sub.bind_to_random_port('tcp://127.0.0.1')}"
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._ready.set()
        while not self._done.is_set():
            if sub.poll(100):
                _topic, _seq, payload = sub.recv_multipart()
                now = time.time()
                self.events.extend(event | {"received_at": now}
                                   for event in decode_batch(payload))
        sub.close(0)
        ctx.term()

    def close(self) -> None:
        self._done.set()
        self.join(10)
