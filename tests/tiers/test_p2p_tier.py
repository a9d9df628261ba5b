"""p2p tier between real processes on loopback: pulls are byte-exact, unauthenticated or
malformed peers get nothing and change nothing, and killed, stopped, slow or restarted peers
end every job within timeout_s."""
from __future__ import annotations

import signal
import socket
import time

import numpy as np
import pytest

from kvhal.tier import JobKind, Lookup, TierJob
from kvhal.tiers.p2p import P2PTier
from kvhal.tiers.p2p.server import MAX_CONNECTIONS, MAX_HANDSHAKING
from kvhal.tiers.p2p.wire import PROTOCOL_VERSION, encode

from .helpers import NAMESPACE, chunk_key, host_region, load, payload, store, wait_for
from .p2p_helpers import PeerProcess, config, free_port

#: Seconds past a job's 1 s `timeout_s` the tests accept before it ended: scheduling slack of a
#: loaded 2-core CI machine (a job that ignored its deadline would never end at all).
DEADLINE_SLACK_S = 2.0


@pytest.fixture
def peers():
    started: list[PeerProcess] = []

    def start(cfg, **kw) -> PeerProcess:
        started.append(PeerProcess(cfg, **kw))
        return started[-1]
    yield start
    for p in started:
        p.kill()


@pytest.fixture
def tiers():
    opened: list[P2PTier] = []

    def make(cfg, nbytes: int = 16 << 20):
        host, array = host_region(nbytes)
        opened.append(P2PTier(cfg, host, NAMESPACE))
        return opened[-1], array
    yield make
    for t in opened:
        t.close()


def served(peer: PeerProcess, count: int) -> None:
    """Wait until `peer` counted `count` chunks served: it counts once its write returned,
    which may be after the puller has the bytes (seen in CI: a KeyError right after a load)."""
    wait_for(lambda: peer.stats().get("chunks_served") == count, what=f"{count} chunks served")


def _timed_load(tier, i: int, offset: int, nbytes: int, job_id: int = 1):
    t0 = time.monotonic()
    result = load(tier, chunk_key(NAMESPACE, i), offset, nbytes, job_id=job_id)
    return result, time.monotonic() - t0


def test_chunks_pulled_from_another_process_are_byte_exact(peers, tiers):
    n = (2 << 20) + 5
    peer = peers(config(), count=3, nbytes=n)
    tier, array = tiers(config(peers=[peer.identity]))
    assert tier.wait_synced(20)

    answers = [tier.lookup(chunk_key(NAMESPACE, i)) for i in range(4)]
    results = [load(tier, chunk_key(NAMESPACE, i), i * n, n, job_id=i) for i in range(3)]

    assert answers == [Lookup.HIT] * 3 + [Lookup.MISS]
    assert [r.ok for r in results] == [True] * 3
    for i in range(3):
        np.testing.assert_array_equal(array[i * n:(i + 1) * n], payload(i, n))
    served(peer, 3)
    assert tier.stats()["bytes_loaded"] == 3 * n


def test_chunks_a_peer_gains_later_appear_without_probing(peers, tiers):
    peer = peers(config(), count=1)
    tier, _ = tiers(config(peers=[peer.identity]))
    assert tier.wait_synced(20)
    assert tier.metrics["peers_connected"].labels().read() == 1

    assert peer.command("store 1 2") == "stored"

    wait_for(lambda: tier.lookup(chunk_key(NAMESPACE, 2)) is Lookup.HIT, what="gain event")
    assert [tier.lookup(chunk_key(NAMESPACE, i)) for i in range(3)] == [Lookup.HIT] * 3


def test_wrong_key_peer_gets_nothing_and_gives_nothing(peers, tiers):
    peer = peers(config(), count=2)
    tier, _ = tiers(config(peers=[peer.identity], auth_key="another-key-another-key"))

    wait_for(lambda: tier.stats().get("auth_failed", 0) >= 1, what="refused handshake")
    result = load(tier, chunk_key(NAMESPACE, 0), 0, 4096)

    assert (tier.stats()["directory_chunks"], tier.lookup(chunk_key(NAMESPACE, 0))) == (
        0, Lookup.MISS)
    assert (result.ok, result.error) == (False, "no peer holds the chunk")
    assert peer.stats().get("chunks_served", 0) == 0


def _raw(address, data: bytes) -> bytes:
    """Send `data` on a fresh connection; return everything received until the peer closes."""
    with socket.create_connection(address, timeout=10) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_malformed_or_unauthenticated_requests_are_dropped_and_counted(peers, tiers):
    peer = peers(config(), count=1)
    get = encode("get", key=chunk_key(NAMESPACE, 0), n=4096)
    attempts = [b"\xff\xff\xff\xff" + b"x" * 64,          # frame length over the limit
                b"\x00\x00\x00\x05\xc1\xc1\xc1\xc1\xc1",  # msgpack reserved bytes
                get,                                      # a request before the handshake
                encode("hello", v=PROTOCOL_VERSION, role="data", nonce=b"n" * 16,
                       id="x") + get]

    replies = [_raw(peer.address, data) for data in attempts]

    assert replies[:3] == [b"", b"", b""]
    assert b"challenge" in replies[3] and len(replies[3]) < 200  # the challenge, no chunk
    stats = peer.stats()
    assert (stats["malformed"], stats.get("chunks_served", 0)) == (4, 0)
    tier, array = tiers(config(peers=[peer.identity]))
    assert tier.wait_synced(20)
    assert load(tier, chunk_key(NAMESPACE, 0), 0, 4096).ok  # the peer is unharmed
    np.testing.assert_array_equal(array[:4096], payload(0, 4096))


#: Silent unauthenticated connections of the flood test: more than a listener serves at once.
FLOOD = MAX_CONNECTIONS + 44


def test_silent_unauthenticated_clients_cannot_starve_a_peer(peers, tiers):
    peer = peers(config(), count=1)
    tier, array = tiers(config(peers=[peer.identity]))
    assert tier.wait_synced(20)
    flood = []
    try:
        flood += [socket.create_connection(peer.address, timeout=10) for _ in range(FLOOD)]

        result, elapsed = _timed_load(tier, 0, 0, 4096)
        # the silent ones still pending time out; the tier's feed and data connections stay
        wait_for(lambda: peer.stats()["connections"] == 2, what="pending handshakes ended")
    finally:
        for s in flood:
            s.close()

    assert result.ok, result.error
    assert elapsed < tier.config.timeout_s + DEADLINE_SLACK_S
    np.testing.assert_array_equal(array[:4096], payload(0, 4096))
    stats = peer.stats()
    # every silent connection was dropped for a newer one or timed out; none of the peer's
    assert stats.get("handshakes_dropped", 0) + stats.get("handshake_timeouts", 0) == FLOOD
    assert stats["handshake_timeouts"] <= MAX_HANDSHAKING
    assert stats.get("connections_refused", 0) == 0
    served(peer, 1)


def test_stale_directory_entry_costs_one_failed_load_then_a_miss(tiers):
    server, _ = tiers(config())
    host_array = np.frombuffer(server._host, dtype=np.uint8)
    host_array[:4096] = payload(5, 4096)
    server.submit_store(TierJob(1, JobKind.STORE, chunk_key(NAMESPACE, 5), 0, 4096))
    server.drain(10)
    client, _ = tiers(config(peers=[server.identity]))
    assert client.wait_synced(20)
    del server._source._data[chunk_key(NAMESPACE, 5)]  # gone without a loss event

    first = load(client, chunk_key(NAMESPACE, 5), 0, 4096, job_id=1)
    second = load(client, chunk_key(NAMESPACE, 5), 0, 4096, job_id=2)

    assert (first.ok, first.error) == (False, f"peer {server.identity}: miss (not held)")
    assert (second.ok, second.error) == (False, "no peer holds the chunk")
    assert client.lookup(chunk_key(NAMESPACE, 5)) is Lookup.MISS


def test_peer_killed_mid_transfer_fails_the_job_in_time(peers, tiers):
    n = 8 << 20
    peer = peers(config(), count=1, nbytes=n, send_delay_s=0.25)
    tier, _ = tiers(config(peers=[peer.identity], timeout_s=10.0), nbytes=n)
    assert tier.wait_synced(20)

    t0 = time.monotonic()
    tier.submit_load(TierJob(1, JobKind.LOAD, chunk_key(NAMESPACE, 0), 0, n))
    wait_for(lambda: peer.stats()["pieces_sent"] >= 1, what="payload flowing")
    peer.kill()
    tier.drain(20)
    (result,) = tier.get_finished_jobs()

    assert not result.ok and result.error.startswith(f"peer {peer.identity}: connection lost")
    assert time.monotonic() - t0 < 10.0
    wait_for(lambda: tier.lookup(chunk_key(NAMESPACE, 0)) is Lookup.MISS, what="peer dropped")


def test_stopped_peer_times_out_is_dropped_and_comes_back(peers, tiers):
    peer = peers(config(), count=1)
    tier, array = tiers(config(peers=[peer.identity], timeout_s=1.0))
    assert tier.wait_synced(20)

    peer.signal(signal.SIGSTOP)
    try:
        result, elapsed = _timed_load(tier, 0, 0, 4096)
        wait_for(lambda: tier.lookup(chunk_key(NAMESPACE, 0)) is Lookup.MISS, 10, "drop")
    finally:
        peer.signal(signal.SIGCONT)

    assert not result.ok and result.error.startswith(f"peer {peer.identity}: timed out")
    assert elapsed < 1.0 + DEADLINE_SLACK_S
    wait_for(lambda: tier.lookup(chunk_key(NAMESPACE, 0)) is Lookup.HIT, what="resync")
    assert load(tier, chunk_key(NAMESPACE, 0), 0, 4096, job_id=2).ok
    np.testing.assert_array_equal(array[:4096], payload(0, 4096))


def test_slow_peer_fails_past_the_deadline_and_succeeds_within_it(peers, tiers):
    n = 4 << 20
    slow = peers(config(), count=1, nbytes=n, send_delay_s=0.4)      # 4 pieces: >= 1.6 s
    tier, array = tiers(config(peers=[slow.identity], timeout_s=1.0), nbytes=n)
    assert tier.wait_synced(20)
    late, elapsed = _timed_load(tier, 0, 0, n)
    patient, _ = tiers(config(peers=[slow.identity], timeout_s=10.0), nbytes=n)
    assert patient.wait_synced(20)

    in_time = load(patient, chunk_key(NAMESPACE, 0), 0, n, job_id=2)

    assert (late.ok, late.error) == (False, f"peer {slow.identity}: timed out")
    assert elapsed < 1.0 + DEADLINE_SLACK_S
    assert in_time.ok
    np.testing.assert_array_equal(np.frombuffer(patient._host, np.uint8)[:n], payload(0, n))


def test_restarted_peer_is_resynchronised(peers, tiers):
    port = free_port()
    first = peers(config(port=port), count=2)
    tier, array = tiers(config(peers=[first.identity]))
    assert tier.wait_synced(20)
    first.kill()
    wait_for(lambda: tier.stats()["directory_chunks"] == 0, what="entries dropped")

    second = peers(config(port=port), count=4)
    wait_for(lambda: tier.lookup(chunk_key(NAMESPACE, 3)) is Lookup.HIT, what="new epoch")

    assert tier.stats()["directory_chunks"] == 4
    assert load(tier, chunk_key(NAMESPACE, 3), 0, 4096).ok
    np.testing.assert_array_equal(array[:4096], payload(3, 4096))
    served(second, 1)


def test_forget_drops_only_the_failing_peers_entries(peers, tiers):
    """Two peers announce a prefix of 6 chunks; the one whose announcement came last (pulled
    first) lost chunks 2-5 behind its feed. Its failed pull of chunk 2 and `forget` drop its
    entries of chunks 3-5 too, and only its: the prefix stays a hit, and chunks 3-5 load from
    the other peer (a real process) at the first try. Fails with `forget` a no-op (each load
    of 3-5 goes to the stale peer first and fails) or dropping every peer's entries (misses)."""
    n = 4096
    keys = [chunk_key(NAMESPACE, i) for i in range(6)]
    other = peers(config(), count=6, nbytes=n)
    stale, stale_array = tiers(config())
    tier, array = tiers(config(peers=[other.identity, stale.identity]))
    assert tier.wait_synced(20)
    for i, key in enumerate(keys):
        stale_array[:n] = payload(i, n)
        assert store(stale, key, 0, n, job_id=i).ok
    wait_for(lambda: tier.in_step_with(stale), what="the stale peer's gains applied")
    for key in keys[2:]:
        del stale._source._data[key]  # gone without a loss event

    failed = load(tier, keys[2], 0, n, job_id=10)
    tier.forget(keys[2:])
    answers = [tier.lookup(k) for k in keys]
    later = [load(tier, k, (1 + i) * n, n, job_id=20 + i).ok for i, k in enumerate(keys[3:])]

    assert (failed.ok, failed.error) == (False, f"peer {stale.identity}: miss (not held)")
    assert answers == [Lookup.HIT] * 6
    assert later == [True] * 3
    for i in range(3):
        np.testing.assert_array_equal(array[(1 + i) * n:(2 + i) * n], payload(3 + i, n))
    served(other, 3)
