"""p2p claims of the package docstring that no other test checks, each against real tiers on
loopback: the puller refuses a chunk announced under another key or length before reading its
payload; a server answers `busy` once `max_inflight` transfers are in flight; a feed snapshot of
more than `MAX_KEYS_PER_FRAME` keys goes out in pages; and what a flood of connections during a
peer's handshake can and cannot do (`MAX_HANDSHAKING`)."""
from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from kvhal.tier import JobKind, Lookup, TierJob
from kvhal.tiers.chunk_format import payload_checksum
from kvhal.tiers.p2p import P2PTier
from kvhal.tiers.p2p.auth import AuthError, client_handshake
from kvhal.tiers.p2p import server as p2p_server
from kvhal.tiers.p2p.server import MAX_HANDSHAKING
from kvhal.tiers.p2p.transport import TcpConnection
from kvhal.tiers.p2p.wire import (MAX_KEYS_PER_FRAME, NONCE_BYTES, PROTOCOL_VERSION, decode,
                                  encode)

from .helpers import NAMESPACE, chunk_key, host_region, load, payload, store, wait_for
from .p2p_helpers import KEY, config
from .p2p_peer import FaultyServingTransport

N = 4096
#: Seconds a test waits for a real condition (met in milliseconds on an idle machine).
WAIT_S = 20.0


@pytest.fixture
def tiers():
    opened: list[P2PTier] = []

    def make(cfg, *, transport=None, stored: int = 0):
        """A tier on a fresh host region holding chunks 0..stored-1 (`payload(i, N)`)."""
        host, array = host_region(1 << 20)
        opened.append(P2PTier(cfg, host, NAMESPACE, transport=transport))
        for i in range(stored):
            array[:N] = payload(i, N)
            assert store(opened[-1], chunk_key(NAMESPACE, i), 0, N).ok
        return opened[-1], array
    yield make
    for t in reversed(opened):
        t.close()


class FaultyLyingTransport(FaultyServingTransport):
    """TCP, except that a served chunk is announced as `key` (if given) and `delta` bytes
    longer than asked, with the payload cut or zero-padded to that length and an `end` digest
    over the bytes sent: a consistent liar, which a real peer never is."""

    def __init__(self, key=None, delta: int = 0):
        self.key, self.delta = key, delta

    def serve(self, send, parts, deadline) -> None:
        header, payload_view, _ = parts
        asked = decode(bytes(header[4:]), "chunk")
        body = bytes(payload_view[:len(payload_view) + self.delta]) + bytes(max(self.delta, 0))
        send((encode("chunk", key=self.key or asked["key"], n=len(body), gen=0), body,
              encode("end", sum=payload_checksum(body))), deadline)


@pytest.mark.parametrize("key,delta", [pytest.param(chunk_key(NAMESPACE, 1), 0, id="another key"),
                                       pytest.param(None, 1, id="one byte more"),
                                       pytest.param(None, -1, id="one byte less")])
def test_a_chunk_announced_under_another_key_or_length_is_refused_unread(tiers, key, delta):
    """Fails when the puller's check of the announced key or length goes (`Puller.pull`'s
    `reply["n"] != len(out) or reply["key"] != key`): without the key check the other key's
    announcement loads as chunk 0; without the length check the payload is read into the slot
    and the pull fails later, as another error (a misread `end` frame, or a timeout)."""
    liar, _ = tiers(config(), transport=FaultyLyingTransport(key, delta), stored=2)
    tier, array = tiers(config(peers=[liar.identity]))
    assert tier.wait_synced(WAIT_S)

    result = load(tier, chunk_key(NAMESPACE, 0), 0, N)

    assert (result.ok, result.error) == (
        False, f"peer {liar.identity}: malformed reply (another chunk announced "
               f"({N + delta} bytes, {N} asked))")
    assert not array[:N].any()                      # the payload never reached the slot
    stats = tier.stats()
    assert (stats["malformed"], stats.get("bytes_loaded", 0), stats["connections"]) == (1, 0, 0)
    assert tier.lookup(chunk_key(NAMESPACE, 0)) is Lookup.MISS   # the entry is forgotten


class FaultyPausedTransport(FaultyServingTransport):
    """TCP, except that each served chunk waits for `resume` before it goes out: its transfer,
    and so its `max_inflight` slot, stays in flight on demand. `paused` counts the waits."""

    def __init__(self):
        self.resume = threading.Event()
        self.paused = 0
        self._lock = threading.Lock()

    def serve(self, send, parts, deadline) -> None:
        with self._lock:
            self.paused += 1
        if not self.resume.wait(WAIT_S):
            raise TimeoutError("never resumed")
        send(parts, deadline)


def _finished(tier, results: dict, job_id: int) -> bool:
    results.update((r.job_id, r) for r in tier.get_finished_jobs())
    return job_id in results


def test_busy_once_max_inflight_transfers_are_in_flight(tiers):
    """Fails when the server admits more or fewer transfers than `max_inflight` (e.g. with
    `Server._serve_data`'s `self._slots.acquire(blocking=False)` check removed the third pull
    is held too and never answered `busy`; with one slot fewer the second pull is `busy`)."""
    paused = FaultyPausedTransport()
    server, _ = tiers(config(max_inflight=2, timeout_s=WAIT_S), transport=paused,
                      stored=1)
    tier, array = tiers(config(peers=[server.identity], num_threads=3, timeout_s=WAIT_S))
    assert tier.wait_synced(WAIT_S)
    results: dict = {}
    try:
        for job_id in (1, 2):
            tier.submit_load(TierJob(job_id, JobKind.LOAD, chunk_key(NAMESPACE, 0),
                                     job_id * N, N))
        wait_for(lambda: paused.paused == 2, WAIT_S, "two transfers in flight")

        tier.submit_load(TierJob(3, JobKind.LOAD, chunk_key(NAMESPACE, 0), 3 * N, N))
        wait_for(lambda: _finished(tier, results, 3), WAIT_S, "the third pull's answer")
    finally:
        paused.resume.set()
    tier.drain(WAIT_S)
    _finished(tier, results, 0)

    assert (results[3].ok, results[3].error) == (False, f"peer {server.identity}: busy")
    assert server.stats()["serve_busy"] == 1
    assert tier.lookup(chunk_key(NAMESPACE, 0)) is Lookup.HIT   # busy does not forget
    assert [results[i].ok for i in (1, 2)] == [True, True]
    for i in (1, 2):
        np.testing.assert_array_equal(array[i * N:(i + 1) * N], payload(0, N))
    assert load(tier, chunk_key(NAMESPACE, 0), 0, N, job_id=4).ok   # room again
    assert paused.paused == 3
    # counted once the server's write returned, which may be after the puller has the bytes
    wait_for(lambda: server.stats().get("chunks_served") == 3, WAIT_S, "three chunks served")


def _connect(address, role: str) -> TcpConnection:
    """A real client connection to `address`, authenticated with the tests' key."""
    conn = TcpConnection(socket.create_connection(address, timeout=WAIT_S))
    client_handshake(conn, KEY.encode(), role, "test:1", time.monotonic() + WAIT_S)
    return conn


def test_a_snapshot_over_max_keys_per_frame_goes_out_in_pages(tiers):
    """Fails when the server stops paging its snapshot or marks the wrong page last (e.g.
    with `Server._serve_feed` sending all keys in one `snap`: a frame of more than
    `MAX_KEYS_PER_FRAME` keys is malformed to the subscriber; or with `last=True` on every
    page: a subscriber installs the first page only)."""
    count = 2 * MAX_KEYS_PER_FRAME + 1
    server, _ = tiers(config())
    for i in range(count):
        server.submit_store(TierJob(i, JobKind.STORE, chunk_key(NAMESPACE, i), 0, 16))
    server.drain(WAIT_S)
    assert all(r.ok for r in server.get_finished_jobs())
    conn = _connect(server._server.address, "feed")
    pages = []
    try:
        while not pages or not pages[-1]["last"]:
            pages.append(conn.recv(time.monotonic() + WAIT_S, "snap"))
    finally:
        conn.close()
    follower, _ = tiers(config(peers=[server.identity]))

    assert [(len(p["keys"]), p["last"]) for p in pages] == [
        (MAX_KEYS_PER_FRAME, False), (MAX_KEYS_PER_FRAME, False), (1, True)]
    assert {(p["epoch"], p["seq"]) for p in pages} == {server.feed_position()}
    assert {k for p in pages for k in p["keys"]} == {chunk_key(NAMESPACE, i)
                                                     for i in range(count)}
    assert follower.wait_synced(WAIT_S)
    assert follower.stats()["directory_chunks"] == count


class FaultyPausedClient(TcpConnection):
    """A `TcpConnection` whose second frame sent (the handshake's `auth`) waits for `resume`
    after setting `paused`: holds a real client between the server's challenge and its proof,
    a slow round trip on demand."""

    def __init__(self, sock: socket.socket):
        super().__init__(sock)
        self.paused, self.resume = threading.Event(), threading.Event()
        self._sent = 0

    def send(self, frame: bytes, deadline: float) -> None:
        self._sent += 1
        if self._sent == 2:
            self.paused.set()
            assert self.resume.wait(WAIT_S)
        super().send(frame, deadline)


def _flooded_handshake(server, flood) -> tuple[bool | str, int | None]:
    """Run a real client's handshake to `server`, calling `flood()` between the server's
    challenge and the client's proof; then ask for chunk 0. Returns (True or the handshake's
    error type, the bytes the server announced for chunk 0 or None)."""
    peer = FaultyPausedClient(socket.create_connection(server._server.address, WAIT_S))
    outcome: list = []

    def authenticate():
        try:
            client_handshake(peer, KEY.encode(), "data", "peer:1", time.monotonic() + WAIT_S)
            outcome.append(True)
        except (AuthError, OSError) as exc:
            outcome.append(type(exc).__name__)
    thread = threading.Thread(target=authenticate)
    thread.start()
    try:
        assert peer.paused.wait(WAIT_S)
        flood()
    finally:
        peer.resume.set()
        thread.join(WAIT_S)
    try:
        if outcome == [True]:
            peer.send(encode("get", key=chunk_key(NAMESPACE, 0), n=N), time.monotonic() + 5)
            return True, peer.recv(time.monotonic() + WAIT_S, "chunk")["n"]
        return outcome[0], None
    finally:
        peer.close()


@pytest.fixture
def flood_sockets(monkeypatch):
    """Sockets and connections of a flood, closed after the test. Handshakes may last
    `WAIT_S` meanwhile (with the tier's `timeout_s`), not `HANDSHAKE_S`: the flood and the
    paused peer must not time out on a loaded machine."""
    monkeypatch.setattr(p2p_server, "HANDSHAKE_S", WAIT_S)
    opened: list = []
    yield opened
    for s in opened:
        s.close()


def test_a_silent_flood_during_a_handshake_cannot_drop_it(tiers, flood_sockets):
    """Connections that keep arriving and stay silent while a peer authenticates (three times
    `MAX_HANDSHAKING` between the server's challenge and the peer's proof) drop each other,
    never the peer, whose hello the server has read. Fails when the bound drops the oldest
    handshake regardless (`next(iter(self._handshaking))` in `Server._accept_loop`: the
    `MAX_HANDSHAKING`-th silent connection drops the peer) or when
    `auth.server_handshake` stops reporting a hello it has heard."""
    server, _ = tiers(config(timeout_s=WAIT_S), stored=1)
    count = 3 * MAX_HANDSHAKING

    def flood():
        flood_sockets.extend(socket.create_connection(server._server.address, WAIT_S)
                             for _ in range(count))
        wait_for(lambda: server.stats().get("handshakes_dropped", 0)
                 == count - (MAX_HANDSHAKING - 1), WAIT_S, "flood accepted")

    assert _flooded_handshake(server, flood) == (True, N)


@pytest.mark.parametrize("count", [MAX_HANDSHAKING - 1, MAX_HANDSHAKING])
def test_a_hello_flood_drops_a_handshake_from_the_max_handshaking_th(tiers, flood_sockets,
                                                                    count):
    """The documented limit of the handshake bound (`server.MAX_HANDSHAKING`): connections
    that each send a hello (and are challenged) while a peer authenticates cannot be told from
    it before their proof, so the oldest handshake goes first: the peer survives
    `MAX_HANDSHAKING - 1` of them and the `MAX_HANDSHAKING`-th drops it. A flood that keeps
    doing that faster than once per round trip of the peer keeps it out while it lasts; the
    peer then retries (its feed link with backoff, its pulls as misses). Fails when the bound
    moves (e.g. `>` for `>=` in `Server._accept_loop`: 17 handshakes held)."""
    server, _ = tiers(config(timeout_s=WAIT_S), stored=1)

    def flood():
        for _ in range(count):   # one by one: the server has heard each before the next
            conn = TcpConnection(socket.create_connection(server._server.address, WAIT_S))
            flood_sockets.append(conn)
            conn.send(encode("hello", v=PROTOCOL_VERSION, role="data",
                             nonce=bytes(NONCE_BYTES), id="flood:1"), time.monotonic() + 5)
            conn.recv(time.monotonic() + WAIT_S, "challenge")

    outcome = _flooded_handshake(server, flood)

    assert (outcome, server.stats().get("handshakes_dropped", 0)) == (
        ((True, N), 0) if count < MAX_HANDSHAKING else (("AuthError", None), 1))
