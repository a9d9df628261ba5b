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


def _port_sockets(port: int) -> int:
    """Sockets of this process with `port` at either end (the peer's listener, its accepted
    connections, the client's connections to it). Sockets of anything else alive in the test
    process are not counted: a CI run saw 2 against 1 open sockets from an earlier test's
    leftover (an HTTP connection pool), unrelated to p2p."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:  # no IPv6
            continue
        for line in lines:
            fields = line.split()
            local, remote, inode = fields[1], fields[2], fields[9]
            ports = {int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16)}
            count += inode in inodes and port in ports
    return count


def _p2p_threads() -> int:
    """Live threads of the p2p tier (named "kvhal-p2p-…"); threads other tests left behind in
    this process come and go on their own and are not counted."""
    return sum(t.name.startswith("kvhal-p2p") for t in threading.enumerate())


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
                counts.append((_port_sockets(port), _p2p_threads()))
        counts.append((_port_sockets(port), _p2p_threads()))
    finally:
        client.close()

    assert counts[1] == counts[0]
    assert client.stats()["peer_lost"] == ROUNDS + 1
