"""The soak's checks besides the answers: a p2p client without the key, sockets left listening,
and each request's wait against its bound.

`nokey_pull`: a raw TCP client speaking the p2p wire protocol (`tiers/p2p/wire.py`) without the
shared key: it says hello, receives the server's challenge (the only frame a keyless client may
get), answers it with a random proof, then asks for real chunks (`get`, keys of the fs tier's
chunk files, which the servers' host tiers hold too). Every byte it receives after the
challenge counts: the p2p tier's promise is 0. A second connection skips the proof and sends
the `get`s right after the hello's challenge, in case a server served before checking it.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import psutil
from kvhal.tiers.fs.format import CHUNKS_DIR, key_from_name
from kvhal.tiers.p2p.wire import (
    LENGTH,
    MAC_BYTES,
    NONCE_BYTES,
    PROTOCOL_VERSION,
    decode,
    encode,
)

from kvhal.keys import ChunkKey

#: Seconds the keyless client waits for anything more after its requests.
NOKEY_WAIT_S = 2.0


def chunk_keys(fs_root: Path, limit: int = 8) -> list[ChunkKey]:
    """Up to `limit` keys of chunk files under the fs tier's `fs_root` (sorted by path)."""
    keys = []
    for ns_dir in sorted(fs_root.iterdir()) if fs_root.is_dir() else []:
        try:
            namespace = bytes.fromhex(ns_dir.name)
        except ValueError:
            continue
        for path in sorted((ns_dir / CHUNKS_DIR).glob("*/*.kv")):
            key = key_from_name(namespace, path.name)
            if key is not None:
                keys.append(key)
            if len(keys) >= limit:
                return keys
    return keys


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    out = b""
    while len(out) < n:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        part = sock.recv(n - len(out))
        if not part:
            raise ConnectionError("closed")
        out += part
    return out


def _drain(sock: socket.socket, wait_s: float) -> int:
    """Bytes received until the server closes or `wait_s` passes."""
    got, deadline = 0, time.monotonic() + wait_s
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            part = sock.recv(1 << 16)
        except OSError:         # a timeout (nothing more came) or a reset (dropped)
            break
        if not part:
            break
        got += len(part)
    return got


def _one(port: int, keys: list[ChunkKey], chunk_bytes: int, prove: bool) -> dict:
    deadline = time.monotonic() + 10.0
    with socket.create_connection(("127.0.0.1", port), timeout=10.0) as sock:
        sock.sendall(encode("hello", v=PROTOCOL_VERSION, role="data",
                            nonce=os.urandom(NONCE_BYTES), id="soak-nokey:0"))
        try:
            n = LENGTH.unpack(_recv_exact(sock, LENGTH.size, deadline))[0]
            decode(_recv_exact(sock, n, deadline), "challenge")
        except (OSError, ConnectionError) as e:
            return {"challenge": False, "bytes_after": 0, "note": str(e)[:100]}
        try:
            if prove:
                sock.sendall(encode("auth", mac=os.urandom(MAC_BYTES)))
            for key in keys:
                sock.sendall(encode("get", key=key, n=chunk_bytes))
        except OSError:
            pass             # dropped already: nothing more can come
        return {"challenge": True, "bytes_after": _drain(sock, NOKEY_WAIT_S)}


def nokey_pull(port: int, keys: list[ChunkKey], chunk_bytes: int) -> dict:
    """Try to pull `keys` (chunks of `chunk_bytes`) from the p2p listener on
    127.0.0.1:`port` without the key, once with a wrong proof and once with none (module
    docstring).

    Returns:
        {"port", "keys", "bytes": bytes received after the challenge on both connections,
        "challenged": connections that got the server's challenge (0 or 1 of 2: the server
        was stopped or went down), "error": why it could not connect, or None}.
    """
    out = {"port": port, "keys": len(keys), "bytes": 0, "challenged": 0, "error": None}
    try:
        for prove in (True, False):
            one = _one(port, keys, chunk_bytes, prove)
            out["bytes"] += one["bytes_after"]
            out["challenged"] += one["challenge"]
    except OSError as e:       # the server is down (a fault) or restarting: nothing learned
        out["error"] = f"{type(e).__name__}: {e}"[:200]
    return out


def listening(ports: list[int]) -> list[dict]:
    """Sockets still listening on any of `ports` (127.0.0.1 or any address), with their pid."""
    ports_ = set(ports)
    return [{"port": c.laddr.port, "pid": c.pid}
            for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port in ports_]


def wait_bound_s(base_s: float, kills: list[tuple[float, float]],
                 stops: list[tuple[float, float]], sent_s: float, done_s: float) -> float:
    """The longest a request sent at `sent_s` and answered at `done_s` may wait: `base_s` (its
    deadline), plus the restart time of each killed server whose kill-to-ready span
    (`kills`: (start, end) seconds) overlaps it, plus the length of each SIGSTOP span
    (`stops`) that overlaps it."""
    extra = sum(end - start for start, end in kills + stops
                if start <= done_s and end >= sent_s)
    return base_s + extra


class NokeyProber(threading.Thread):
    """Runs `nokey_pull` against every p2p port not marked down, at start and then every
    `every_s` seconds, until `stop` is set; `results` holds each try (with `at_s`, seconds
    after `t0`)."""

    def __init__(self, ports: list[int], down: list[threading.Event], fs_root: Path,
                 chunk_bytes: int, every_s: float, t0: float):
        super().__init__(name="soak-nokey", daemon=True)
        self.ports, self.down, self.fs_root, self.every_s, self.t0 = (ports, down, fs_root,
                                                                      every_s, t0)
        self.chunk_bytes = chunk_bytes
        self.stop = threading.Event()
        self.results: list[dict] = []

    def run(self) -> None:
        while True:
            keys = chunk_keys(self.fs_root)
            for i, port in enumerate(self.ports):
                if not self.down[i].is_set():
                    self.results.append(nokey_pull(port, keys, self.chunk_bytes)
                                        | {"at_s": time.monotonic() - self.t0})
            if self.stop.wait(self.every_s):
                return
