"""p2p reconnects (slow): 100 restarts of a serving peer leak no socket and no thread, and
every round's pull succeeds on fresh connections."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from kvhal.tiers.base import JobKind, Lookup, TierJob
from kvhal.tiers.p2p import P2PTier

from .helpers import NAMESPACE, chunk_key, host_region, load, payload, wait_for
from .p2p_helpers import config, free_port

pytestmark = pytest.mark.slow

ROUNDS = 100


def _open_fds() -> int:
    """Open sockets of this process. Other descriptors come and go with whatever else runs in
    the test process (a directory being listed by a background scan left by an earlier test:
    a run saw 20 against 19 fds), so only sockets are counted."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:  # closed meanwhile
            pass
    return count


def _serve_one(port: int, round_: int) -> P2PTier:
    host, array = host_region(1 << 20)
    tier = P2PTier(config(port=port), host, NAMESPACE)
    array[:4096] = payload(round_, 4096)
    tier.submit_store(TierJob(0, JobKind.STORE, chunk_key(NAMESPACE, round_), 0, 4096))
    tier.drain(10)
    return tier


def test_hundred_peer_restarts_leak_no_sockets_or_threads():
    port = free_port()
    host, array = host_region(1 << 20)
    client = P2PTier(config(peers=[f"127.0.0.1:{port}"]), host, NAMESPACE)
    counts = []
    try:
        for r in range(ROUNDS + 1):
            server = _serve_one(port, r)
            wait_for(lambda: client.lookup(chunk_key(NAMESPACE, r)) is Lookup.HIT,
                     what=f"sync {r}")  # the peer's feed reached the directory
            result = load(client, chunk_key(NAMESPACE, r), 0, 4096, job_id=r)
            assert result.ok, f"round {r}: {result.error}"
            np.testing.assert_array_equal(array[:4096], payload(r, 4096))
            server.close()
            wait_for(lambda: client.stats()["peers_synced"] == 0, what=f"loss {r}")
            wait_for(lambda: client.stats()["connections"] == 0, what=f"closed {r}")
            if r == 1:  # after a first round has warmed everything up
                counts.append((_open_fds(), threading.active_count()))
        counts.append((_open_fds(), threading.active_count()))
    finally:
        client.close()

    assert counts[1] == counts[0]
    assert client.stats()["peer_lost"] == ROUNDS + 1
