"""obj tier faults, from a real moto_server behind `FaultyS3Proxy` and a real server killed:
every job ends as a failure within `timeout_s`, drain and close keep their deadlines, and the
same tier works again once the server does."""
from __future__ import annotations

import time

import numpy as np
import pytest

from conformance.s3 import BUCKET, Fault, FaultyS3Proxy
from kvhal.tier import JobKind, Lookup, TierJob
from kvhal.tiers.obj import ObjTier
from kvhal.tiers.obj.client import S3Client
from kvhal.tiers.obj.local_server import LocalS3Server

from .helpers import NAMESPACE, chunk_key, host_region, load, payload, store
from .helpers import wait_for
from .test_obj_tier import obj_config

#: Short enough for quick fault tests, long enough for a healthy 256 KiB request on a loaded
#: 2-core machine (one attempt gets half of it).
TIMEOUT_S = 4.0
N = 256 << 10

FAULTS = {
    "500": (Fault("status", status=500, code="InternalError"), "HTTP 500 InternalError (EIO)"),
    "503-slowdown": (Fault("status", status=503, code="SlowDown"), "HTTP 503 SlowDown (EIO)"),
    "403": (Fault("status", status=403, code="AccessDenied"), "HTTP 403 AccessDenied (EACCES)"),
    "stops-answering": (Fault("stall"), "failed (ETIMEDOUT)"),
    "cut-mid-transfer": (Fault("cut"), "failed (ECONNRESET)"),
}


@pytest.fixture
def proxy(s3_server):
    with FaultyS3Proxy(s3_server.port) as p:
        yield p


@pytest.fixture
def tier(proxy):
    host, array = host_region()
    t = ObjTier(obj_config(proxy.endpoint, timeout_s=TIMEOUT_S, refresh_interval_s=3600), host,
                NAMESPACE)
    t.array = array
    yield t
    t.close()


def _stored(tier, i: int) -> None:
    tier.array[:N] = payload(i, N)
    assert store(tier, chunk_key(NAMESPACE, i), 0, N, job_id=i).ok


def _recovers(tier, i: int) -> None:
    """A store and a verified load of a new chunk succeed on the same tier."""
    _stored(tier, i)
    tier.array[N:2 * N] = 0
    assert load(tier, chunk_key(NAMESPACE, i), N, N, job_id=1000 + i).ok
    np.testing.assert_array_equal(tier.array[N:2 * N], payload(i, N))


@pytest.mark.parametrize("name", FAULTS)
@pytest.mark.parametrize("op", ["GET", "PUT"])
def test_a_server_fault_fails_the_job_within_timeout_then_the_tier_recovers(proxy, tier, name,
                                                                            op):
    fault, error = FAULTS[name]
    _stored(tier, 1)
    proxy.set_fault(Fault(fault.kind, (op,), status=fault.status, code=fault.code))
    tier.array[N:2 * N] = 0
    t0 = time.monotonic()

    result = (load(tier, chunk_key(NAMESPACE, 1), N, N) if op == "GET"
              else store(tier, chunk_key(NAMESPACE, 2), 0, N))

    assert time.monotonic() - t0 < TIMEOUT_S
    assert (result.ok, result.error) == (False, f"{op} {error}")
    assert proxy.injected >= 1
    proxy.set_fault(None)
    _recovers(tier, 3)


def _requests(tier) -> dict[tuple[str, str], float]:
    """The tier's `requests` counter by (op, outcome), LIST left out (the start's and the
    refresher's)."""
    return {k: c.read() for k, c in tier.metrics["requests"].series().items()
            if k[0] != "LIST" and c.read()}


def test_404_on_load_is_a_miss_and_a_removal(proxy, tier):
    _stored(tier, 1)
    proxy.set_fault(Fault("status", ("GET",), status=404, code="NoSuchKey"))

    result = load(tier, chunk_key(NAMESPACE, 1), N, N)

    assert (result.ok, result.error) == (False, "not found: GET HTTP 404 NoSuchKey (ENOENT)")
    assert _requests(tier) == {("PUT", "ok"): 1, ("GET", "ENOENT"): 1}
    assert tier.lookup(chunk_key(NAMESPACE, 1)) is Lookup.MISS
    assert tier.take_removed() == [chunk_key(NAMESPACE, 1)]


def test_one_slowdown_is_retried_and_the_job_succeeds(proxy, tier):
    _stored(tier, 1)
    proxy.set_fault(Fault("status", ("GET",), status=503, code="SlowDown", remaining=1))

    result = load(tier, chunk_key(NAMESPACE, 1), N, N)

    assert (result.ok, proxy.injected) == (True, 1)
    np.testing.assert_array_equal(tier.array[N:2 * N], payload(1, N))
    assert _requests(tier) == {("PUT", "ok"): 1, ("GET", "EIO"): 1, ("GET", "ok"): 1}
    assert {k: c.read() for k, c in tier.metrics["retries"].series().items()} == {("GET",): 1}


def test_connection_refused_fails_fast_and_the_tier_recovers_when_the_port_is_back(proxy,
                                                                                   tier):
    _stored(tier, 1)
    proxy.refuse()

    results = [load(tier, chunk_key(NAMESPACE, 1), N, N, job_id=1),
               store(tier, chunk_key(NAMESPACE, 2), 0, N, job_id=2)]
    proxy.resume()

    assert [(r.ok, r.error) for r in results] == [(False, "GET failed (ECONNREFUSED)"),
                                                   (False, "PUT failed (ECONNREFUSED)")]
    assert all(r.seconds < TIMEOUT_S for r in results)
    _recovers(tier, 3)


def test_drain_and_close_keep_their_deadlines_against_a_server_that_stops_answering(proxy,
                                                                                    tier):
    for i in range(4):
        _stored(tier, i)
    proxy.set_fault(Fault("stall", objects_only=False))
    for i in range(4):
        tier.submit_load(TierJob(10 + i, JobKind.LOAD, chunk_key(NAMESPACE, i), i * N, N))
        tier.submit_store(TierJob(20 + i, JobKind.STORE, chunk_key(NAMESPACE, 50 + i), 0, N))

    with pytest.raises(TimeoutError):
        tier.drain(0.05)
    t0 = time.monotonic()
    tier.close()

    assert time.monotonic() - t0 < TIMEOUT_S + 0.5
    results = tier.get_finished_jobs()
    assert sorted((r.job_id, r.ok) for r in results) == [(10 + i, False) for i in range(4)] + [
        (20 + i, False) for i in range(4)]


def test_a_put_cut_mid_upload_fails_and_leaves_no_object(proxy, tier):
    """The proxy reads half of the PUT's body, hands the server that half and resets the
    client: the job fails with a connection error within `timeout_s`, the key stays a miss,
    and the bucket holds no object for it (the server got a short body), then the tier
    recovers.

    Fails when a PUT the server did not receive whole is reported ok or indexed: e.g. with
    `ObjTier._store` taking a failed PUT for written (`except StoreFailure` indexing the key
    and going on), or with a server that keeps a short body as the object.
    """
    n = 4 << 20  # well over a loopback socket's buffers: the client is still sending
    host, array = host_region(2 * n)
    t = ObjTier(obj_config(proxy.endpoint, timeout_s=TIMEOUT_S, refresh_interval_s=3600),
                host, NAMESPACE)
    try:
        array[:n] = payload(4, n)
        proxy.set_fault(Fault("cut-upload", ("PUT",)))
        t0 = time.monotonic()

        result = store(t, chunk_key(NAMESPACE, 4), 0, n)

        assert time.monotonic() - t0 < TIMEOUT_S
        assert (result.ok, result.error) == (False, "PUT failed (ECONNRESET)")
        assert proxy.cut_uploads >= 1
        assert t.lookup(chunk_key(NAMESPACE, 4)) is Lookup.MISS
        t.refresh()
        assert t.lookup(chunk_key(NAMESPACE, 4)) is Lookup.MISS
        assert names_under(t) == []
        proxy.set_fault(None)
        assert store(t, chunk_key(NAMESPACE, 4), 0, n).ok
        assert names_under(t) == [t.object_name(chunk_key(NAMESPACE, 4))]
    finally:
        t.close()


def names_under(tier) -> list[str]:
    """Every object under the tier's namespace, listed straight from the server."""
    client = S3Client(tier.config.store, 10.0, 2)
    return [name for name, _, _ in client.list(tier.ns_prefix)]


@pytest.mark.slow
def test_a_server_killed_mid_transfer_fails_jobs_in_time_and_a_restarted_one_is_used(
        tmp_path):
    """Loads whose responses are provably in flight (the proxy has sent each GET's head and
    first 256 KiB, and holds the rest) when the server is SIGKILLed: each fails with a
    connection error within `timeout_s` (the server's socket buffers cannot hold the rest of
    an 8 MiB object: the body ends short); after a restart on the same port (empty store) the
    tier finds its chunks gone and works again.

    Fails when a load whose body was cut off is reported ok, fails as anything but a
    connection error, or ends later than `timeout_s`: e.g. with `ObjTier._load` retrying a
    failed GET on its own (every 0.2 s, 50 times) the loads end after more than 10 s.
    """
    n, loads = 8 << 20, 4
    server = LocalS3Server().start()
    proxy = FaultyS3Proxy(server.port)
    try:
        server.create_bucket(BUCKET)
        host, array = host_region(8 * n)
        timeout_s = 10.0  # 8 MiB PUTs through the proxy on a loaded 2-core machine take seconds
        config = obj_config(proxy.endpoint, timeout_s=timeout_s, refresh_interval_s=0.05,
                            io_threads=loads)
        tier = ObjTier(config, host, NAMESPACE)
        keys = [chunk_key(NAMESPACE, i) for i in range(loads)]
        for i, key in enumerate(keys):
            array[i * n:(i + 1) * n] = payload(i, n)
            assert store(tier, key, i * n, n, job_id=i).ok
        array[:] = 0
        proxy.set_fault(Fault("hold", ("GET",), hold_bytes=256 << 10))
        for i, key in enumerate(keys):
            tier.submit_load(TierJob(10 + i, JobKind.LOAD, key, i * n, n))
        proxy.wait_holding(loads, 60.0)     # every GET has bytes in flight
        server.kill()
        t0 = time.monotonic()
        proxy.release()
        tier.drain(timeout_s + 0.5)
        results = tier.get_finished_jobs()
        assert time.monotonic() - t0 < timeout_s + 0.5
        assert sorted((r.job_id, r.ok, r.error) for r in results) == [
            (10 + i, False, "GET failed (ECONNRESET)") for i in range(loads)]

        proxy.set_fault(None)
        server = LocalS3Server(port=server.port).start()   # same endpoint, empty store
        server.create_bucket(BUCKET)
        wait_for(lambda: all(tier.lookup(k) is Lookup.MISS for k in keys), 30.0)
        assert sorted(tier.take_removed(), key=keys.index) == keys
        array[:n] = payload(7, n)
        assert store(tier, chunk_key(NAMESPACE, 7), 0, n, job_id=7).ok
        assert load(tier, chunk_key(NAMESPACE, 7), n, n, job_id=8).ok
        np.testing.assert_array_equal(array[n:2 * n], payload(7, n))
        tier.close()
    finally:
        proxy.close()
        server.kill()
