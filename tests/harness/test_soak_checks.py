"""`kvhal soak`'s checks and fault tools against real services, no vLLM: the keyless p2p client
against a real p2p listener, object damage and same-port restarts against a real
`moto_server`, the restarts of both by the fault thread (a kill -9'd Mooncake pool member
rejoining after them, in separate processes), and the wait bound."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from kvhal.integrations.harness.soak import checks, fleet
from kvhal.integrations.harness.soak import faults as faultlib
from kvhal.tiers.p2p import P2PTier
from kvhal.tiers.p2p.client import Puller
from kvhal.tiers.p2p.transport import TcpTransport

from conformance.tier_fixtures import chunk_key
from tests.tiers.helpers import NAMESPACE, host_region
from tests.tiers.p2p_helpers import KEY, serving_tier
from tests.tiers.test_mooncake_tier import ROOT, N, worker


@pytest.fixture
def p2p_server():
    """A real p2p tier in this process serving chunk 0 (4096 bytes of 7s) from its own store."""
    yield from serving_tier()


def _port(tier: P2PTier) -> int:
    return int(tier.identity.rsplit(":", 1)[1])


def test_a_keyless_client_gets_no_bytes_of_a_chunk_the_server_holds(p2p_server):
    """Fails when the server serves a `get` before (or without) checking the client's proof
    (tried: `server_handshake` skipping its `compare_digest`: 4,219 bytes came)."""
    got = checks.nokey_pull(_port(p2p_server), [chunk_key(NAMESPACE, 0)], 4096)
    assert got == {"port": _port(p2p_server), "keys": 1, "bytes": 0, "challenged": 2,
                   "error": None}


def test_the_keyless_client_counts_what_a_server_would_send(p2p_server):
    """The probe can see bytes: with the key, a real client pulls the same chunk (so a 0 above
    is the server refusing, not the chunk missing)."""
    import time
    puller = Puller(TcpTransport(), KEY.encode(), "test:1", lambda *a: None)
    host, array = host_region(1 << 20)
    try:
        puller.pull(("127.0.0.1", _port(p2p_server)), chunk_key(NAMESPACE, 0), host[:4096],
                    time.monotonic() + 5)
    finally:
        puller.close()
    assert (array[:4096] == 7).all()


def test_a_keyless_pull_at_a_closed_port_is_an_error_not_bytes():
    got = checks.nokey_pull(fleet.free_port(), [], 4096)
    assert got["bytes"] == 0 and "ConnectionRefused" in got["error"]


@pytest.fixture
def moto():
    pytest.importorskip("moto.server", reason="needs moto[server] (the dev extra)")
    server = fleet.start_s3()
    assert server is not None
    yield server
    server.kill()


def _put(endpoint: str, name: str, data: bytes) -> None:
    faultlib.s3_client(endpoint, fleet.S3_KEYS).put_object(Bucket=fleet.BUCKET, Key=name, Body=data)


def _get(endpoint: str, name: str) -> bytes:
    got = faultlib.s3_client(endpoint, fleet.S3_KEYS).get_object(Bucket=fleet.BUCKET, Key=name)
    return got["Body"].read()


def test_objects_are_truncated_or_overwritten_in_moto(moto):
    body = bytes(range(256)) * 64
    for name in ("soak/a.kv", "soak/b.kv", "soak/c.kv"):
        _put(moto.endpoint, name, body)
    assert faultlib.object_names(moto.endpoint, fleet.BUCKET, fleet.S3_KEYS) == ["soak/a.kv", "soak/b.kv",
                                                                  "soak/c.kv"]
    name = faultlib.damage_object(moto.endpoint, fleet.BUCKET, fleet.S3_KEYS,
                                  faultlib.Fault(1.0, "obj_truncate", 0, 4))
    assert name == "soak/b.kv" and _get(moto.endpoint, name) == body[:8192]
    name = faultlib.damage_object(moto.endpoint, fleet.BUCKET, fleet.S3_KEYS,
                                  faultlib.Fault(1.0, "obj_overwrite", 0, 5))
    got = _get(moto.endpoint, name)
    assert name == "soak/c.kv" and len(got) == len(body) and got != body
    assert got[:8192] == body[:8192]


def test_moto_restarts_on_the_same_port_with_its_bucket_gone(moto):
    """Fails when a restart moves moto to a new port (the servers' configs name the old one:
    the first soak test run failed so)."""
    endpoint = moto.endpoint
    _put(endpoint, "soak/x.kv", b"x" * 100)
    fleet.restart_same_port(moto, moto.port)
    assert moto.endpoint == endpoint and moto.running
    moto.create_bucket(fleet.BUCKET)
    assert faultlib.object_names(endpoint, fleet.BUCKET, fleet.S3_KEYS) == []


def test_listening_names_a_socket_on_a_watched_port_only():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        found = checks.listening([port, fleet.free_port()])
        assert [f["port"] for f in found] == [port]
    assert checks.listening([port]) == []


def test_the_wait_bound_adds_the_kills_and_stops_a_request_overlapped():
    kills, stops = [(10.0, 40.0)], [(50.0, 62.0)]
    assert checks.wait_bound_s(30.0, kills, stops, 0.0, 5.0) == 30.0
    assert checks.wait_bound_s(30.0, kills, stops, 35.0, 55.0) == 30.0 + 30.0 + 12.0
    assert checks.wait_bound_s(30.0, kills, stops, 41.0, 49.0) == 30.0


class PortHeldOnce:
    """Wraps a `LocalS3Server` for `restart_same_port`; another socket holds the server's port
    until the first start fails on it (so a retry is needed, with no timing guess)."""

    def __init__(self, server):
        import socket
        self.server, self.failed = server, []
        self.holder = socket.socket()
        self.holder.bind(("127.0.0.1", server.port))
        self.holder.listen()

    def kill(self) -> None:
        self.server.kill()

    def start(self):
        try:
            return self.server.start()
        except RuntimeError as e:
            self.failed.append(str(e))
            self.holder.close()
            raise


def test_a_restart_waits_for_its_port_to_be_free_again(moto):
    """Another process holding the port at the restart delays it, never moves it. Fails when
    a held port makes the restart give up at once (tried: no retry in `restart_same_port`)."""
    endpoint = moto.endpoint
    moto.kill()
    held = PortHeldOnce(moto)
    fleet.restart_same_port(held, moto.port)
    assert len(held.failed) == 1 and "in use" in held.failed[0]
    assert moto.running and moto.endpoint == endpoint
    moto.create_bucket(fleet.BUCKET)
    assert faultlib.object_names(moto.endpoint, fleet.BUCKET, fleet.S3_KEYS) == []


def test_moto_the_fault_thread_restarted_outlives_the_schedule(moto, tmp_path):
    """moto restarted by the Faulter thread is its child and dies with it (PR_SET_PDEATHSIG);
    the thread must outlive its schedule until released. Fails when `Faulter.run` returns at
    the schedule's end (seen: moto gone, then every server restart refused)."""
    import time

    from kvhal.integrations.harness.soak.driver import Faulter
    faulter = Faulter([faultlib.Fault(0.0, "s3_restart", 0, 0)], [], moto, tmp_path, tmp_path,
                      False, time.monotonic(), lambda i: None, lambda i: None)
    faulter.start()
    assert faulter.idle.wait(60) and faulter.error is None
    try:
        faulter.join(0.5)        # (alive: it waits for `release`)
        deadline = time.monotonic() + 5.0
        while not faulter.is_alive() and moto.running and time.monotonic() < deadline:
            time.sleep(0.05)     # a thread that ended takes its moto child within this
        assert faulter.is_alive() and moto.running
        assert faultlib.object_names(moto.endpoint, fleet.BUCKET, fleet.S3_KEYS) == []
    finally:
        faulter.release.set()
        faulter.join()


def _member(config: dict, *args: str) -> subprocess.Popen:
    """A separate process with the mooncake tier of `config` (`tests.tiers.obj_worker ...
    hold`): a pool member until its stdin closes or it is killed."""
    return subprocess.Popen([sys.executable, "-m", "tests.tiers.obj_worker", json.dumps(config),
                             *args, "hold"], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def _pool_capacity(master) -> float:
    """The bytes of every segment the master counts mounted (`master_total_capacity_bytes`)."""
    from kvhal.tiers.mooncake.pool_figures import PoolFigures
    figures = PoolFigures(f"http://127.0.0.1:{master.metrics_port}/metrics", 3600.0)
    figures.close()
    return figures.capacity


def _await_capacity(master, nbytes: int, timeout_s: float = 60.0) -> None:
    """Wait until the master counts `nbytes` of mounted segments (AssertionError after
    `timeout_s`, with the last figure)."""
    import time
    deadline = time.monotonic() + timeout_s
    while (capacity := _pool_capacity(master)) != nbytes and time.monotonic() < deadline:
        time.sleep(0.2)
    assert capacity == nbytes


def test_a_pool_member_killed_after_the_faults_rejoins_the_pool_the_faulter_restarted(tmp_path):
    """The soak's 'setup returned -1' at a kvhal server's restart (3 starts in a row): the
    mooncake_master restarted by the Faulter thread (`mooncake_restart`) is that thread's child
    (PR_SET_PDEATHSIG) and died when the thread ended after its schedule, so every later start
    found no master. Here, as in the soak: a member joins, the Faulter restarts the master, the
    schedule ends, the member is killed with -9 while the master still counts it, and a new
    member process starts on the same config: it joins, and its segment serves the pool (a
    third process stores into it, a fourth loads it back byte-exact). Fails when `Faulter.run`
    returns at the schedule's end (tried: 'mooncake_master died with the Faulter thread'; a
    member started then fails as the soak's did: 20 setup tries, 'setup returned -1' after
    92 s)."""
    import time

    from kvhal.integrations.harness.soak.driver import Faulter
    from kvhal.tiers.mooncake.local_master import LocalMaster

    from conformance.mooncake import require
    require()
    # client_ttl 20 s (the soak's master: 10 s): room for the new member's start under load
    master = LocalMaster({"client_ttl": "20"}, str(tmp_path / "master.log")).start()
    config = fleet.mooncake_tier(master)
    first = _member(config, "load", "0", "0", str(N))
    faulter = Faulter([faultlib.Fault(0.0, "mooncake_restart", 0, 0)], [], None, tmp_path,
                      tmp_path, False, time.monotonic(), lambda i: None, lambda i: None, master)
    members = [first]
    try:
        assert json.loads(first.stdout.readline()) == {"ok": [], "errors": []}
        faulter.start()
        assert faulter.idle.wait(60) and faulter.error is None, faulter.error
        faulter.join(0.5)         # (alive: it waits for `release`)
        deadline = time.monotonic() + 5.0
        while not faulter.is_alive() and master.running and time.monotonic() < deadline:
            time.sleep(0.05)      # a thread that ended takes its master child within this
        assert master.running, "mooncake_master died with the Faulter thread"
        segment = config["global_segment_size"]
        _await_capacity(master, segment)      # the member remounted on the restarted master
        first.kill()              # SIGKILL: the master keeps counting it until client_ttl
        first.wait()
        again = _member(config, "load", "0", "0", str(N))
        members.append(again)
        assert json.loads(again.stdout.readline()) == {"ok": [], "errors": []}
        assert _pool_capacity(master) == 2 * segment   # joined beside the dead member
        _await_capacity(master, segment)      # the dead one's segment goes at client_ttl
        lender_free = config | {"global_segment_size": 0}
        assert worker(lender_free, "store", 1, 1, N) == {"ok": [1], "errors": []}
        assert worker(lender_free, "load", 1, 1, N) == {"ok": [1], "errors": []}
    finally:
        for member in members:
            member.kill()
            member.wait()
        faulter.release.set()
        if faulter.ident is not None:
            faulter.join()
        master.kill()
