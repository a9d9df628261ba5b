"""The keeper peer of the p2p conformance harness: `python -m conformance.p2p_keeper SPEC`.

A p2p chunk lives only in the memory of the instances serving it, so for the suite's
restart and multi-process tests a chunk "persists" once a second instance holds it, as an
instance that reused the prefix would. The keeper is that instance: a real `P2PTier` in its own
process (the harness starts it, `conformance/p2p.py`) that every p2p instance of the test lists
as its only peer. `settle` in a storing process asks it, over a Unix socket, to pull one chunk
from that process (`tiers.p2p.client.Puller`: the tier's own pull, key, length and xxh3-128
checked) and to store it into its own LRU store; from then on every instance finds the chunk
in the keeper's feed and pulls it from the keeper.

SPEC is the path of a JSON file: `auth_key_file`, `max_bytes`, `namespace` (hex), `control`
(the Unix socket path). Prints one JSON line `{"identity": "host:port"}` once it listens on
both; serves control requests one at a time:

    hold HOST:PORT KEYHEX NBYTES   →  "held" | "failed: why"

(KEYHEX: `ChunkKey.to_bytes().hex()`). Exits 0 at EOF on stdin, closing its tier; the harness
also arms SIGKILL on its death (`kvhal.procs.die_with_parent`).
"""
from __future__ import annotations

import json
import mmap
import os
import selectors
import socket
import sys
import time

from kvhal.keys import ChunkKey
from kvhal.tier import JobKind, Lookup, TierJob
from kvhal.tiers.p2p import P2PTier
from kvhal.tiers.p2p.client import Puller, PullError
from kvhal.tiers.p2p.config import parse_address
from kvhal.tiers.p2p.transport import TcpTransport

#: Bytes of the keeper's host region: the largest chunk it can pull (the suite's are ≤ 4 MiB).
HOST_BYTES = 8 << 20
#: Seconds one pull or store may take.
TIMEOUT_S = 20.0


class Keeper:
    """The keeper's tier and its puller (see module docstring)."""

    def __init__(self, spec: dict):
        self._region = mmap.mmap(-1, HOST_BYTES)
        self._host = memoryview(self._region)
        self.tier = P2PTier({"type": "p2p", "auth_key_file": spec["auth_key_file"],
                             "max_bytes": spec["max_bytes"], "timeout_s": TIMEOUT_S},
                            self._host, bytes.fromhex(spec["namespace"]))
        self._puller = Puller(TcpTransport(), self.tier.config.auth_key, self.tier.identity,
                              lambda *_: None)
        self._job_id = 0

    def hold(self, source: str, key: ChunkKey, nbytes: int) -> str | None:
        """Pull `key` (`nbytes`) from `source` and store it; None, or why not."""
        if self.tier.lookup(key) is Lookup.HIT:
            return None  # held already (a same-key writer settled it first)
        if not 0 < nbytes <= HOST_BYTES:
            return f"{nbytes} bytes do not fit the keeper's {HOST_BYTES}-byte host region"
        peer = parse_address(source, "source")
        try:
            self._puller.pull(peer, key, self._host[:nbytes], time.monotonic() + TIMEOUT_S)
        except PullError as exc:
            return str(exc)
        finally:  # the asking process may end at once, and a later one may get its port
            self._puller.forget_peer(peer)
        self._job_id += 1
        self.tier.submit_store(TierJob(self._job_id, JobKind.STORE, key, 0, nbytes))
        self.tier.drain(TIMEOUT_S)
        (result,) = self.tier.get_finished_jobs()
        return result.error

    def close(self) -> None:
        self._puller.close()
        self.tier.close()


def _answer(keeper: Keeper, conn: socket.socket) -> None:
    conn.settimeout(TIMEOUT_S)
    with conn, conn.makefile("rw") as f:
        words = f.readline().split()
        if len(words) != 4 or words[0] != "hold":
            f.write("failed: expected 'hold HOST:PORT KEYHEX NBYTES'\n")
            return
        error = keeper.hold(words[1], ChunkKey.from_bytes(bytes.fromhex(words[2])),
                            int(words[3]))
        f.write("held\n" if error is None else f"failed: {error}\n")


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        spec = json.load(f)
    keeper = Keeper(spec)
    control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    control.bind(spec["control"])
    control.listen(16)
    print(json.dumps({"identity": keeper.tier.identity}), flush=True)
    events = selectors.DefaultSelector()
    events.register(control, selectors.EVENT_READ)
    events.register(sys.stdin, selectors.EVENT_READ)
    try:
        while True:
            for ready, _ in events.select():
                if ready.fileobj is sys.stdin:
                    if not os.read(sys.stdin.fileno(), 4096):
                        return 0  # EOF: the harness is done with us
                    continue
                conn, _ = control.accept()
                try:
                    _answer(keeper, conn)
                except OSError:
                    pass  # the asking process died (a SIGKILLed writer): nothing to answer
    finally:
        control.close()
        keeper.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
