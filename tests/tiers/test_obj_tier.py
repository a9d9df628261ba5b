"""obj tier against a real moto_server: sharing across processes, names, conditional PUT,
max_bytes GC and removals, objects deleted elsewhere, start errors, the AWS chain, secrets."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from conformance.s3 import ACCESS_KEY, BUCKET, SECRET_KEY, Fault, FaultyS3Proxy, store_config
from kvhal.tier import Lookup, TierError
from kvhal.tiers.chunk_format import record_nbytes
from kvhal.tiers.obj import ObjTier
from kvhal.tiers.obj.client import S3Client
from kvhal.tiers.obj.config import parse_config

from .helpers import NAMESPACE, chunk_key, host_region, load, payload, store, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def obj_config(endpoint: str, **extra) -> dict:
    """A config on a fresh prefix of the test bucket."""
    return {"type": "obj", "store_config": store_config(endpoint),
            "prefix": f"tests/{uuid.uuid4().hex}", "refresh_interval_s": 0.05,
            "timeout_s": 5.0} | extra


def raw_client(config: dict) -> S3Client:
    return S3Client(parse_config(config).store, 10.0, 2)


def names_under(config: dict) -> list[str]:
    return [n for n, _, _ in raw_client(config).list(config["prefix"] + "/")]


def worker(config: dict, op: str, first: int, count: int, nbytes: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "tests.tiers.obj_worker", json.dumps(config),
                          op, str(first), str(count), str(nbytes)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture
def region():
    return host_region()


@pytest.fixture
def open_obj(s3_server):
    opened = []

    def make(config: dict, host) -> ObjTier:
        opened.append(ObjTier(config, host, NAMESPACE))
        return opened[-1]

    yield make
    for tier in opened:
        tier.close()


def test_two_processes_sharing_a_bucket_see_each_others_chunks(s3_server, open_obj, region):
    host, array = region
    config = obj_config(s3_server.endpoint)
    here = open_obj(config, host)          # this process, started before the other stores
    n = 300001

    stored = worker(config, "store", 0, 4, n)
    wait_for(lambda: all(here.lookup(chunk_key(NAMESPACE, i)) is Lookup.HIT for i in range(4)), 30.0)
    loads = [load(here, chunk_key(NAMESPACE, i), i * n, n, job_id=i) for i in range(4)]
    loaded = [array[i * n:(i + 1) * n].copy() for i in range(4)]
    array[:n] = payload(9, n)
    mine = store(here, chunk_key(NAMESPACE, 9), 0, n, job_id=9)
    other = worker(config, "load", 9, 1, n)   # a fresh process, its index built by LIST

    assert stored == {"ok": [0, 1, 2, 3], "errors": []}
    assert [r.ok for r in loads] == [True] * 4
    for i in range(4):
        np.testing.assert_array_equal(loaded[i], payload(i, n))
    assert mine.ok and other == {"ok": [9], "errors": []}


def test_objects_are_content_addressed_records_under_prefix_and_namespace(s3_server, open_obj,
                                                                          region):
    host, array = region
    config = obj_config(s3_server.endpoint)
    tier = open_obj(config, host)
    key = chunk_key(NAMESPACE, 5)
    array[:70000] = payload(5, 70000)

    assert store(tier, key, 0, 70000).ok

    name = f"{config['prefix']}/{NAMESPACE.hex()}/{key.hex()}.kv"
    assert tier.object_name(key) == name
    assert [(n, s) for n, s, _ in raw_client(config).list(config["prefix"] + "/")] == [
        (name, record_nbytes(70000))]


def test_storing_an_existing_key_is_success_without_rewriting(s3_server, open_obj, region):
    host, array = region
    config = obj_config(s3_server.endpoint, refresh_interval_s=3600)
    first, second = open_obj(config, host), None
    key = chunk_key(NAMESPACE, 1)
    array[:5000] = payload(1, 5000)
    assert store(first, key, 0, 5000).ok
    before = raw_client(config).get(first.object_name(key)).tobytes()
    second = open_obj(dict(config, prefix=config["prefix"]), host)
    second._index.discard(key)   # as if its listing had not seen the object yet
    array[:5000] = payload(2, 5000)

    again = store(second, key, 0, 5000, job_id=2)

    assert again.ok
    assert second.stats()["already_stored"] == 1 and "bytes_stored" not in second.stats()
    assert raw_client(config).get(first.object_name(key)).tobytes() == before


def test_a_forgotten_object_still_there_is_replaced_by_its_next_store(s3_server, open_obj,
                                                                       region):
    """A failed load of an earlier chunk makes the engine forget this one (`forget`): its
    object is still in the bucket, corrupt, and a listing even brings the key back, but its
    next store replaces it (an unconditional PUT: bytes_stored, not already_stored) and it
    loads byte-exact. Fails with the conditional PUT kept for a forgotten key: the corrupt
    object stays and the store counts as already stored."""
    from kvhal.tiers.chunk_format import HEADER_BYTES
    host, array = region
    config = obj_config(s3_server.endpoint, refresh_interval_s=3600)
    tier = open_obj(config, host)
    key = chunk_key(NAMESPACE, 3)
    array[:5000] = payload(3, 5000)
    assert store(tier, key, 0, 5000).ok
    raw, name = raw_client(config), tier.object_name(key)
    record = bytearray(raw.get(name))
    record[HEADER_BYTES + 17] ^= 0x10
    raw.delete([name])
    assert raw.put(name, memoryview(record))

    tier.forget([key])
    tier.refresh()
    relisted = tier.lookup(key)
    again = store(tier, key, 0, 5000, job_id=2)
    reloaded = load(tier, key, 5000, 5000, job_id=3)

    assert relisted is Lookup.HIT
    assert again.ok
    assert tier.stats()["bytes_stored"] == 2 * 5000 and "already_stored" not in tier.stats()
    assert reloaded.ok
    np.testing.assert_array_equal(array[5000:10000], payload(3, 5000))


def test_max_bytes_deletes_least_recently_used_objects_and_reports_removals(s3_server, open_obj,
                                                                            region):
    host, array = region
    n = 64 << 10
    config = obj_config(s3_server.endpoint, max_bytes=3 * record_nbytes(n))
    tier = open_obj(config, host)
    keys = [chunk_key(NAMESPACE, i) for i in range(5)]
    for i, key in enumerate(keys):
        array[:n] = payload(i, n)
        assert store(tier, key, 0, n, job_id=i).ok

    wait_for(lambda: len(names_under(config)) == 3, 30.0)
    assert sorted(names_under(config)) == sorted(tier.object_name(k) for k in keys[2:])
    assert tier.take_removed() == keys[:2]
    assert tier.take_removed() == []
    stats = tier.stats()
    assert (stats["evictions"], stats["deleted"], stats["used_bytes"]) == (
        2, 2, 3 * record_nbytes(n))


def test_an_object_deleted_by_another_instance_is_a_miss_and_a_removal(s3_server, open_obj,
                                                                       region):
    host, array = region
    config = obj_config(s3_server.endpoint, refresh_interval_s=3600)
    tier = open_obj(config, host)
    keys = [chunk_key(NAMESPACE, i) for i in range(2)]
    for i, key in enumerate(keys):
        array[:4096] = payload(i, 4096)
        assert store(tier, key, 0, 4096, job_id=i).ok
    raw_client(config).delete([tier.object_name(k) for k in keys])

    gone = load(tier, keys[0], 8192, 4096)
    tier.refresh()

    assert (gone.ok, gone.error) == (False, "not found: GET HTTP 404 NoSuchKey (ENOENT)")
    assert [tier.lookup(k) for k in keys] == [Lookup.MISS] * 2
    assert tier.take_removed() == keys
    assert tier.stats()["missing"] == 1


def test_a_missing_bucket_at_start_is_one_error_naming_bucket_and_endpoint(s3_server, region):
    config = obj_config(s3_server.endpoint)
    config["store_config"]["bucket"] = "no-such-bucket"
    with pytest.raises(TierError) as exc:
        ObjTier(config, region[0], NAMESPACE)
    assert str(exc.value) == (f"store_config.bucket: bucket 'no-such-bucket' at endpoint "
                              f"{s3_server.endpoint} does not exist (LIST HTTP 404 NoSuchBucket "
                              f"(ENOENT))")


def test_denied_credentials_at_start_are_one_error_naming_bucket_and_endpoint(s3_server,
                                                                              region):
    with FaultyS3Proxy(s3_server.port) as proxy:
        proxy.set_fault(Fault("status", ("GET",), objects_only=False, status=403,
                              code="InvalidAccessKeyId"))
        with pytest.raises(TierError) as exc:
            ObjTier(obj_config(proxy.endpoint), region[0], NAMESPACE)
    assert str(exc.value) == (
        f"store_config.access_key: access to bucket '{BUCKET}' at endpoint {proxy.endpoint} "
        "denied (LIST HTTP 403 InvalidAccessKeyId (EACCES)); check access_key / secret_key / "
        "session_token or the AWS credential chain")
    assert SECRET_KEY not in str(exc.value) and ACCESS_KEY not in str(exc.value)


def test_an_endpoint_down_at_start_starts_empty_and_lists_once_it_answers(region, caplog):
    """An S3 endpoint that does not answer while a server (re)starts is a cache outage, not a
    config error (`kvhal soak` found vLLM refusing to restart 8 times while moto was slow):
    the tier starts at once with an empty index and a warning naming the endpoint (never the
    keys), and indexes the bucket as soon as the endpoint answers. Fails when the start
    listing's failure is fatal again (TierError) or the tier waits for the next
    `refresh_interval_s` (60 s here) before trying again."""
    from kvhal.tiers.obj.local_server import LocalS3Server, free_port
    host, array = region
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    config = obj_config(endpoint, timeout_s=2.0, refresh_interval_s=60.0)
    key = chunk_key(NAMESPACE, 3)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="kvhal.tiers.obj.tier"):
        tier = ObjTier(config, host, NAMESPACE)
    try:
        started_s = time.monotonic() - t0
        assert tier.lookup(key) is Lookup.MISS and tier.stats()["listed"] is False
        with LocalS3Server(port) as server:
            server.create_bucket(BUCKET)
            writer = ObjTier(config, host, NAMESPACE)
            try:
                array[:4096] = payload(3, 4096)
                assert store(writer, key, 0, 4096).ok
            finally:
                writer.close()
            wait_for(lambda: tier.lookup(key) is Lookup.HIT, 20.0, "the first listing")
            array[:4096] = 0
            assert load(tier, key, 0, 4096).ok
            np.testing.assert_array_equal(array[:4096], payload(3, 4096))
        assert tier.stats()["listed"] is True
    finally:
        tier.close()
    assert started_s < 2.0
    text = caplog.text
    assert (f"cannot list bucket '{BUCKET}' at endpoint {endpoint} at start (LIST failed "
            "(ECONNREFUSED)); starting with an empty index") in text
    assert f"bucket '{BUCKET}' at endpoint {endpoint} listed after a failed start" in text
    assert SECRET_KEY not in text and ACCESS_KEY not in text


def test_missing_keys_fall_back_to_the_aws_credential_chain(s3_server, open_obj, region,
                                                            monkeypatch, tmp_path):
    credentials = tmp_path / "credentials"
    credentials.write_text(f"[default]\naws_access_key_id = {ACCESS_KEY}\n"
                           f"aws_secret_access_key = {SECRET_KEY}\n")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                 "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    config = obj_config(s3_server.endpoint)
    del config["store_config"]["access_key"], config["store_config"]["secret_key"]
    host, array = region
    tier = open_obj(config, host)
    array[:4096] = payload(3, 4096)

    assert store(tier, chunk_key(NAMESPACE, 3), 0, 4096).ok
    credentials.unlink()
    with pytest.raises(TierError) as exc:
        ObjTier(config, host, NAMESPACE)
    assert str(exc.value) == (
        "store_config.access_key: no access_key/secret_key given and the AWS credential chain "
        "(environment, ~/.aws files, instance metadata) found none for bucket "
        f"'{BUCKET}' at endpoint {s3_server.endpoint}")


def test_secrets_reach_no_log_error_repr_or_stats(s3_server, open_obj, region, caplog):
    """No key, secret or token in the repr, stats, job errors or logs of a tier through every
    fault, the refresh thread's failures (logged) included: it waits on `refresh_errors`, not
    on a sleep. Fails when a secret reaches any of them; the wait fails when refresh failures
    are not counted (e.g. with `count("refresh_errors")` removed from `_refresh_loop`)."""
    caplog.set_level(logging.DEBUG)
    host, array = region
    with FaultyS3Proxy(s3_server.port) as proxy:
        # a cut connection must be noticed as a reset well within one attempt (timeout_s / 2)
        config = obj_config(proxy.endpoint, timeout_s=8.0, refresh_interval_s=0.01)
        config["store_config"]["session_token"] = SECRET_KEY + "-token"
        tier = open_obj(config, host)
        array[:4096] = payload(1, 4096)
        results = [store(tier, chunk_key(NAMESPACE, 1), 0, 4096)]
        for i, fault in enumerate((Fault("status", status=403, code="SignatureDoesNotMatch"),
                                   Fault("status", status=500, code="InternalError"),
                                   Fault("cut"), Fault("stall", objects_only=False))):
            proxy.set_fault(fault)
            results += [load(tier, chunk_key(NAMESPACE, 1), 8192, 4096),
                        store(tier, chunk_key(NAMESPACE, 10 + i), 0, 4096)]
            proxy.set_fault(None)
        failed = tier.stats().get("refresh_errors", 0)
        proxy.refuse()
        # two more failed refreshes (logged): the second surely against the refused port (the
        # first may be a LIST the stall held, dropped by the refusal)
        wait_for(lambda: tier.stats().get("refresh_errors", 0) >= failed + 2, 30.0,
                 "the refresh thread to fail against the refused port")
        results.append(load(tier, chunk_key(NAMESPACE, 1), 8192, 4096))

    text = "\n".join([repr(tier), str(tier.stats()), caplog.text]
                     + [r.error or "" for r in results])
    assert [(r.ok, r.error) for r in results] == [(True, None)] + [(False, e) for e in (
        "GET HTTP 403 SignatureDoesNotMatch (EACCES)", "PUT HTTP 403 SignatureDoesNotMatch "
        "(EACCES)", "GET HTTP 500 InternalError (EIO)", "PUT HTTP 500 InternalError (EIO)",
        "GET failed (ECONNRESET)", "PUT failed (ECONNRESET)", "GET failed (ETIMEDOUT)",
        "PUT failed (ETIMEDOUT)", "GET failed (ECONNREFUSED)")]
    assert "refresh failed: LIST failed (ECONNREFUSED)" in caplog.text
    for secret in (SECRET_KEY, ACCESS_KEY):
        assert secret not in text


def test_a_shared_bucket_is_announced_by_every_instance_that_can_load_it(s3_server):
    """Fleet-shared tier (README, "Metrics and KV events inside vLLM"): chunks another instance
    stores in the bucket are announced by this one's engine once its listing finds them
    (medium STORAGE, locality REMOTE), so a router credits both instances; and removed when
    they leave the bucket. Fails when listings' finds are not announced (only the writer would
    be credited)."""
    from tests.engine.rig import make_rig

    config = obj_config(s3_server.endpoint)
    rig = make_rig(capacity=4, blocks_per_chunk=1, block_bytes=4096, num_blocks=8,
                   tiers=[config], ns=NAMESPACE)
    try:
        rig.manager.take_events()
        assert worker(config, "store", 0, 3, 4096)["ok"] == [0, 1, 2]   # another instance
        keys = [chunk_key(NAMESPACE, i) for i in range(3)]
        tier = rig.manager.tiers[0]
        wait_for(lambda: all(tier.lookup(k) is Lookup.HIT for k in keys), what="listing")
        rig.manager.poll()
        found = rig.manager.take_events()
        raw_client(config).delete([n for n in names_under(config)])
        wait_for(lambda: all(tier.lookup(k) is Lookup.MISS for k in keys), what="deletion")
        rig.manager.poll()
        gone = rig.manager.take_events()
    finally:
        rig.close()
    assert {(e.medium, e.locality, e.tier) for e in found + gone} == {("STORAGE", "REMOTE",
                                                                       "obj")}
    assert sorted(h for e in found for h in e.block_hashes) == sorted(k.block_hash for k in keys)
    assert [type(e).__name__ for e in found + gone] == ["BlockStored", "BlockRemoved"]
    assert sorted(h for e in gone for h in e.block_hashes) == sorted(k.block_hash for k in keys)
