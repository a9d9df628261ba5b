"""Helpers of the p2p tests: peer processes (`p2p_peer.py`), configs, polling with deadlines."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

from kvhal.procs import (
    bindable,
    free_port,  # noqa: F401  (re-exported for the p2p tests)
)

#: The shared secret of the tests' peers (a test value).
KEY = "kvhal-test-p2p-shared-key"
REPO = Path(__file__).resolve().parents[2]


def fixed_port(span: int = 1) -> int:
    """A TCP port free on 127.0.0.1 now, with the `span` - 1 ports after it (a p2p base port
    and its data-parallel engines' ports), all below the kernel's ephemeral range, so no
    ephemeral bind or outgoing connection takes them while a slow process starts to listen."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(max(1024, low - 12000), low - span + 1)
        if all(bindable(p) for p in range(port, port + span)):
            return port
    raise RuntimeError(f"no {span} free TCP ports in a row below the ephemeral range")


def config(**extra) -> dict:
    """A p2p config on 127.0.0.1 with the tests' key and a short timeout."""
    return {"type": "p2p", "auth_key": KEY, "timeout_s": 2.0} | extra


class PeerProcess:
    """A p2p peer in a separate process serving chunks 0..count-1 (see `p2p_peer.py`)."""

    #: The module run in the peer process.
    MODULE = "tests.tiers.p2p_peer"

    def __init__(self, cfg: dict, count: int = 0, nbytes: int = 4096,
                 send_delay_s: float = 0.0):
        self._spawn(dict(cfg, count=count, nbytes=nbytes, send_delay_s=send_delay_s))

    def _spawn(self, spec: dict) -> None:
        """Start `MODULE` with `spec` and read the identity it announces first."""
        self.proc = subprocess.Popen([sys.executable, "-m", self.MODULE, json.dumps(spec)],
                                     cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(30)
            raise RuntimeError(f"{self.MODULE} exited with {self.proc.returncode}")
        self.identity: str = json.loads(line)["identity"]
        host, port = self.identity.rsplit(":", 1)
        self.address = (host, int(port))

    def command(self, text: str) -> str:
        """Send one command line; return its one-line answer."""
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def stats(self) -> dict:
        """The peer tier's stats."""
        return json.loads(self.command("stats"))

    def signal(self, sig: int) -> None:
        """Send `sig` to the process."""
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.proc.poll() is None:
            self.signal(signal.SIGKILL)
        self.proc.wait(30)
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()

    def close(self) -> int:
        """Close stdin (the peer closes its tier) and return the exit code."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.proc.wait(30)
        self.proc.stdout.close()
        return self.proc.returncode


def serving_tier():
    """Yield a real p2p tier in this process serving chunk 0 (4096 bytes of 7s) from its own
    store; closed after (the body of a pytest fixture)."""
    from kvhal.tiers.p2p import P2PTier

    from conformance.tier_fixtures import chunk_key, store
    from tests.tiers.helpers import NAMESPACE, host_region
    host, array = host_region(1 << 20)
    tier = P2PTier(config(), host, NAMESPACE)
    array[:4096] = 7
    assert store(tier, chunk_key(NAMESPACE, 0), 0, 4096).ok
    yield tier
    tier.close()
