"""`kvhal fsck s3://...` and `kvhal bench tier --tier obj` as a user runs them (real moto)."""
from __future__ import annotations

import json
import uuid

import pytest

from conformance.s3 import SECRET_KEY, Fault, FaultyS3Proxy
from kvhal.tiers.chunk_format import record_nbytes
from kvhal.tiers.obj import ObjTier

from .helpers import NAMESPACE, chunk_key, host_region, payload, store
from ..cli import kvhal, timed_kvhal
from .test_fs_cli import assert_bench_passes_fit
from .test_obj_tier import obj_config, raw_client


def _bucket_with_damage(endpoint: str) -> tuple[dict, list[str]]:
    """Four 10000-byte chunks under a fresh prefix; one bit-flipped, one cut short."""
    config = obj_config(endpoint, prefix=f"fsck/{uuid.uuid4().hex}")
    host, array = host_region(1 << 20)
    tier = ObjTier(config, host, NAMESPACE)
    names = []
    for i in range(4):
        array[:10000] = payload(i, 10000)
        assert store(tier, chunk_key(NAMESPACE, i), 0, 10000).ok
        names.append(tier.object_name(chunk_key(NAMESPACE, i)))
    tier.close()
    client = raw_client(config)
    flipped = bytearray(client.get(names[1]))
    flipped[5000] ^= 0x10
    cut = bytes(client.get(names[3]))[:6000]
    client.delete([names[1], names[3]])
    client.put(names[1], memoryview(flipped))
    client.put(names[3], memoryview(cut))
    return config, names


def test_fsck_of_a_bucket_reports_damage_and_repair_deletes_it(s3_server, monkeypatch):
    config, names = _bucket_with_damage(s3_server.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", config["store_config"]["access_key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", config["store_config"]["secret_key"])
    url = f"s3://{config['store_config']['bucket']}/{config['prefix']}"

    out = kvhal("fsck", url, "--endpoint", s3_server.endpoint, "--json")
    repaired = kvhal("fsck", url, "--endpoint", s3_server.endpoint, "--repair")
    after = kvhal("fsck", url, "--endpoint", s3_server.endpoint, "--json")

    assert out.returncode == 1, out.stderr
    report = json.loads(out.stdout)
    assert {k: report[k] for k in ("namespaces", "good", "good_bytes", "corrupt",
                                   "corrupt_bytes")} == {
        "namespaces": 1, "good": 2, "good_bytes": 2 * 16384, "corrupt": 2,
        "corrupt_bytes": 16384 + 6000}
    bucket = config["store_config"]["bucket"]
    assert sorted(report["problems"]) == sorted([
        [f"s3://{bucket}/{names[1]}", "checksum mismatch"],
        [f"s3://{bucket}/{names[3]}", "record size 6000 != expected 16384"]])
    assert out.stderr == ("kvhal fsck: 2 corrupt chunk file(s); run with --repair to "
                          "delete them\n")
    assert repaired.returncode == 0, repaired.stderr
    assert sorted(n for n, _, _ in raw_client(config).list(config["prefix"] + "/")) == sorted(
        [names[0], names[2]])
    assert (after.returncode, json.loads(after.stdout)["good"]) == (0, 2)


def test_fsck_repair_leaves_an_unreadable_object_alone_and_says_so(s3_server, monkeypatch):
    config, names = _bucket_with_damage(s3_server.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", config["store_config"]["access_key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", config["store_config"]["secret_key"])
    url = f"s3://{config['store_config']['bucket']}/{config['prefix']}"
    with FaultyS3Proxy(s3_server.port) as proxy:  # the first GET (of some object) is denied
        proxy.set_fault(Fault("status", methods=("GET",), status=403, code="AccessDenied",
                              remaining=1))
        out = kvhal("fsck", url, "--endpoint", proxy.endpoint, "--repair", "--json")

    report = json.loads(out.stdout)
    unreadable = [p for p, why in report["problems"] if why.startswith("unreadable")]
    assert (out.returncode, report["unreadable"], report["corrupt"] + report["good"],
            len(unreadable)) == (1, 1, 3, 1), out.stderr
    assert out.stderr.endswith("kvhal fsck: 1 chunk object(s) could not be read (not "
                               "verified, left alone); run again\n")
    left = sorted(n for n, _, _ in raw_client(config).list(config["prefix"] + "/"))
    assert unreadable[0].split("/", 3)[3] in left  # never deleted
    assert SECRET_KEY not in out.stdout + out.stderr


def test_fsck_of_a_missing_bucket_or_without_credentials_is_one_line(s3_server, monkeypatch,
                                                                     tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    no_credentials = kvhal("fsck", "s3://no-such-bucket/x", "--endpoint", s3_server.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDTEST")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    missing = kvhal("fsck", "s3://no-such-bucket/x", "--endpoint", s3_server.endpoint)

    where = f"bucket 'no-such-bucket' at endpoint {s3_server.endpoint}"
    assert (no_credentials.returncode, no_credentials.stderr) == (1, (
        "kvhal fsck: error: no access_key/secret_key given and the AWS credential chain "
        f"(environment, ~/.aws files, instance metadata) found none for {where}\n"))
    assert (missing.returncode, missing.stderr) == (
        1, f"kvhal fsck: error: cannot list {where}: LIST HTTP 404 NoSuchBucket (ENOENT)\n")


@pytest.mark.slow
def test_bench_tier_obj_prints_tier_and_raw_loop_side_by_side():
    """The rows, the kvhal tier's own counters (2 passes of 4 chunks of 256 KiB stored and
    loaded, fresh keys each pass) and passes that fit in the command's time. Fails with the
    same keys every pass (bench `block_hash` without the pass): 4 chunks stored, not 8."""
    out, wall_s, cpu_s = timed_kvhal("bench", "tier", "--tier", "obj", "--chunk-bytes",
                                     "256KiB", "--count", "4", "--repeats", "2", "--json")
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout)
    assert (figures["tier"], figures["chunk_bytes"], figures["count"]) == ("obj", 256 << 10, 4)
    assert [c["name"] for c in figures["contenders"]] == ["kvhal obj", "raw obstore", "raw boto3"]
    stats = figures["kvhal_stats"]
    assert (stats["bytes_stored"], stats["bytes_loaded"], stats["chunks"], stats["used_bytes"]) == (
        2 * 4 * (256 << 10), 2 * 4 * (256 << 10), 2 * 4, 2 * 4 * record_nbytes(256 << 10))
    assert_bench_passes_fit(figures, wall_s, cpu_s)
    assert all(isinstance(figures[f"{d}_vs_{c}"], float) for d in ("write", "read")
               for c in ("raw", "boto3"))
