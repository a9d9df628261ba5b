"""A p2p peer in its own process, for the p2p tests: `python -m tests.tiers.p2p_peer CONFIG`.

CONFIG is a JSON object: the p2p tier config plus `"count"` and `"nbytes"` (chunks
`chunk_key(NAMESPACE, i)` with bytes `payload(i, nbytes)` for i < count, stored at start) and
optionally `"send_delay_s"` (seconds slept before each payload piece it sends: a slow peer,
injected by `FaultySlowTransport`). Prints one JSON line `{"identity": "host:port"}` once it
serves, then reads commands from stdin: `store FIRST COUNT` (store more chunks, answers
`stored`), `stats` (answers the tier's stats as JSON, plus `pieces_sent`, payload MiB sent,
of a slow peer); EOF closes the tier and exits 0.
"""
from __future__ import annotations

import json
import mmap
import sys
import time

import numpy as np

from kvhal.tier import JobKind, TierJob
from kvhal.tiers.p2p import P2PTier
from kvhal.tiers.p2p.transport import TcpListener, TcpTransport

from .helpers import NAMESPACE, chunk_key, payload


class FaultyServingTransport(TcpTransport):
    """TCP, except that every chunk its listeners' connections serve goes through
    `serve(send, parts, deadline)`: `parts` are the `chunk` frame, the payload view and the
    `end` frame, `send` the connection's own `send_parts`. The base of the serving faults."""

    def serve(self, send, parts, deadline) -> None:
        send(parts, deadline)

    def listen(self, host, port):
        listener = TcpListener(host, port)
        accept = listener.accept

        def faulty_accept():
            conn = accept()
            if conn is not None:
                send = conn.send_parts
                conn.send_parts = lambda parts, deadline: self.serve(send, parts, deadline)
            return conn
        listener.accept = faulty_accept
        return listener


class FaultySlowTransport(FaultyServingTransport):
    """TCP, except that served payloads pause `delay_s` before every MiB (a slow peer)."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s
        self.pieces_sent = 0

    def serve(self, send, parts, deadline) -> None:
        header, payload, end = parts
        send((header,), deadline)
        for start in range(0, len(payload), 1 << 20):
            time.sleep(self.delay_s)
            send((payload[start:start + (1 << 20)],), deadline)
            self.pieces_sent += 1
        send((end,), deadline)


def _store(tier, host, first: int, count: int, nbytes: int) -> None:
    array = np.frombuffer(host, dtype=np.uint8)
    for i in range(first, first + count):
        array[:nbytes] = payload(i, nbytes)
        tier.submit_store(TierJob(i, JobKind.STORE, chunk_key(NAMESPACE, i), 0, nbytes))
        tier.drain(30)
    failed = [r.error for r in tier.get_finished_jobs() if not r.ok]
    if failed:
        raise SystemExit(f"p2p_peer: stores failed: {failed[:3]}")


def main(argv: list[str]) -> int:
    config = json.loads(argv[0])
    count, nbytes = config.pop("count", 0), config.pop("nbytes", 4096)
    delay = config.pop("send_delay_s", 0.0)
    host = memoryview(mmap.mmap(-1, max(nbytes, 4096)))
    transport = FaultySlowTransport(delay) if delay else None
    tier = P2PTier(config, host, NAMESPACE, transport=transport)
    _store(tier, host, 0, count, nbytes)
    print(json.dumps({"identity": tier.identity}), flush=True)
    for line in sys.stdin:
        words = line.split()
        if words[:1] == ["store"]:
            _store(tier, host, int(words[1]), int(words[2]), nbytes)
            print("stored", flush=True)
        elif words[:1] == ["stats"]:
            extra = {"pieces_sent": transport.pieces_sent} if transport else {}
            print(json.dumps(dict(tier.stats()) | extra), flush=True)
    tier.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
