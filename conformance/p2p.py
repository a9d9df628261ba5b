"""The p2p tier's conformance harness: the instances of one test, and the keeper peer process.

Store = make the chunk available to peers; load = pull it from a peer. A test that needs a chunk
to outlive the instance or the process that stored it (restart, concurrent processes, SIGKILLed
writers) runs with `keeper(tmp_dir, namespace)`: a separate process (`p2p_keeper.py`, started
with `sys.executable`, SIGKILLed if this process dies) that every instance of the test lists as
its peer. `settle` hands a stored chunk to the keeper (it pulls the chunk over the wire from the
storing process); every other instance then finds the chunk in the keeper's feed and pulls it
from the keeper, in another process. Without a keeper (single-instance tests) an instance
serves itself over loopback: the tier's own capacity, LRU and damage semantics.

The shared key is written to `<tmp_dir>/p2p/auth_key` (mode 0600) and reaches every process as
`auth_key_file`, never on a command line or in a log. Waits are on conditions with deadlines:
the keeper's "listening" line, the instances' feed installed (`P2PTier.wait_synced`), the
keeper's "held" answer.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import select
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from kvhal.keys import ChunkKey
from kvhal.procs import die_with_parent

#: The shared secret of the suite's p2p instances (a test value, not a real secret).
P2P_TEST_KEY = "kvhal-conformance-p2p-key"
#: Seconds for the keeper to start listening, and for a new instance to install its feed.
START_TIMEOUT_S = 30.0
#: Seconds the keeper may take to pull and store one chunk.
SETTLE_TIMEOUT_S = 60.0
_REPO = Path(__file__).resolve().parents[1]


def _folder(tmp: str) -> str:
    return os.path.join(tmp, "p2p")


def _key_file(tmp: str) -> str:
    path = os.path.join(_folder(tmp), "auth_key")
    os.makedirs(_folder(tmp), exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path
    with os.fdopen(fd, "w") as f:
        f.write(P2P_TEST_KEY)
    return path


def config(tmp: str, max_bytes: int) -> dict[str, Any]:
    """The config of every p2p instance of the test storing under `tmp` (peer: the keeper, if
    one runs); `tmp` "" (no store folder): an instance with the key inline and no peers."""
    cfg: dict[str, Any] = {"type": "p2p", "max_bytes": max_bytes or 1 << 30, "timeout_s": 10.0}
    if not tmp:
        return cfg | {"auth_key": P2P_TEST_KEY}
    cfg["auth_key_file"] = _key_file(tmp)
    running = os.path.join(_folder(tmp), "keeper.json")
    if os.path.exists(running):
        with open(running) as f:
            cfg["peers"] = [json.load(f)["identity"]]
    return cfg


def ready(tier) -> None:
    """Wait until a new instance has installed its peers' feeds (it sees what they hold).

    Raises:
        AssertionError: a peer refused our auth key, or not within `START_TIMEOUT_S`.
    """
    deadline = time.monotonic() + START_TIMEOUT_S
    while not tier.wait_synced(0.05):
        if tier.stats().get("auth_failed"):
            raise AssertionError(f"p2p instance {tier.identity}: a peer refused the auth key")
        if time.monotonic() > deadline:
            raise AssertionError(f"p2p instance {tier.identity}: peers' feeds not installed "
                                 f"within {START_TIMEOUT_S} s")


def _first_line(proc: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        readable, _, _ = select.select([proc.stdout], [], [], deadline - time.monotonic())
        if readable:
            return proc.stdout.readline()
    return ""


@contextlib.contextmanager
def keeper(tmp: str, namespace: bytes) -> Iterator[str]:
    """Run the keeper peer (see module docstring) for the test storing under `tmp`; yields its
    identity ("host:port"). Stopped at exit (EOF on its stdin, then SIGKILL after 10 s); it
    also gets SIGKILL if this process dies.

    Raises:
        RuntimeError: it exited or did not listen within `START_TIMEOUT_S`.
    """
    folder = _folder(tmp)
    spec = {"auth_key_file": _key_file(tmp), "max_bytes": 1 << 30, "namespace": namespace.hex(),
            "control": "\0kvhal-p2p-keeper-" + os.urandom(8).hex()}  # abstract Unix socket
    spec_path = os.path.join(folder, "keeper-spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    proc = subprocess.Popen([sys.executable, "-m", "conformance.p2p_keeper", spec_path],
                            cwd=_REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, preexec_fn=die_with_parent)
    running = os.path.join(folder, "keeper.json")
    try:
        line = _first_line(proc, START_TIMEOUT_S)
        if not line:
            raise RuntimeError(f"p2p keeper did not listen within {START_TIMEOUT_S} s "
                               f"(exit code {proc.poll()})")
        identity = json.loads(line)["identity"]
        with open(running, "w") as f:
            json.dump({"identity": identity, "control": spec["control"]}, f)
        yield identity
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(running)
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()


def settle(tier, config: dict[str, Any], key: ChunkKey, nbytes: int) -> None:
    """Hand chunk `key` (`nbytes`, stored ok through `tier`) to the test's keeper: it pulls it
    from `tier` over the wire and holds it. No keeper running: nothing to do.

    Raises:
        AssertionError: the keeper did not hold it (its answer says why) or is unreachable.
    """
    running = os.path.join(os.path.dirname(config.get("auth_key_file", "")), "keeper.json")
    if not config.get("peers") or not os.path.exists(running):
        return
    with open(running) as f:
        control = json.load(f)["control"]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(SETTLE_TIMEOUT_S)
            s.connect(control)
            s.sendall(f"hold {tier.identity} {key.to_bytes().hex()} {nbytes}\n".encode())
            with s.makefile() as f:
                answer = f.readline().strip()
    except OSError as exc:
        answer = f"keeper unreachable ({type(exc).__name__}: {exc})"
    if answer != "held":
        raise AssertionError(f"p2p keeper did not take chunk {key.hex()}: {answer or 'no answer'}")


def damage(tier, config, key, kind, seed) -> None:
    """Damage the chunk `key` in the own store of a single (keeper-less) instance, behind the
    feed's back, so that the directory keeps a now-stale entry."""
    store = tier._source  # tiers/p2p/source.py OwnStore
    data, checksum = store._data[key]
    if kind == "delete":
        del store._data[key]
        return
    rng = random.Random(seed)
    if kind == "truncate":
        store._data[key] = (data[:rng.randrange(len(data))], checksum)
        return
    pos = rng.randrange(len(data))
    flipped = bytearray(data)
    flipped[pos] ^= 1 << rng.randrange(8)
    store._data[key] = (bytes(flipped), checksum)
