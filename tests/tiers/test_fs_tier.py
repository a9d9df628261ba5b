"""fs tier behaviour beyond the conformance suite: files, quarantine, restart, namespaces,
orphaned temp files, ENOSPC, O_DIRECT detection, bad jobs."""
from __future__ import annotations

import os
import shutil
import time

import numpy as np
import pytest

from conformance.tier_harness import _tiny_tmpfs
from kvhal.keys import ChunkKey
from kvhal.tiers.base import JobKind, Lookup, TierJob
from kvhal.tiers.fs import FsTier
from kvhal.tiers.fs.fileio import probe_o_direct
from kvhal.tiers.fs.format import QUARANTINE_DIR, TEMP_DIR, chunk_path

from .helpers import (NAMESPACE, OTHER_NAMESPACE, chunk_key, dead_pid, host_region, load,
                      payload, store)


@pytest.fixture
def region():
    return host_region()


def _open(root, host, namespace=NAMESPACE, **config) -> FsTier:
    return FsTier({"root_dir": str(root), "refresh_interval_s": 3600} | config, host, namespace)


@pytest.mark.parametrize("o_direct", ["auto", False])
def test_o_direct_is_detected_and_reported(tmp_path, region, o_direct):
    tier = _open(tmp_path, region[0], o_direct=o_direct)
    tier.close()
    expected = o_direct == "auto" and probe_o_direct(str(tmp_path))
    assert (tier.o_direct, tier.stats()["o_direct"]) == (expected, expected)


def test_a_corrupt_chunk_is_quarantined_and_counted(tmp_path, region):
    host, array = region
    tier = _open(tmp_path, host)
    key = chunk_key(NAMESPACE, 1)
    array[:5000] = payload(1, 5000)
    assert store(tier, key, 0, 5000).ok
    path = chunk_path(tier.ns_dir, key)
    with open(path, "r+b") as f:
        f.seek(4096 + 4999)
        f.write(b"\x00" if array[4999] else b"\x01")

    result = load(tier, key, 8192, 5000)

    assert (result.ok, result.error) == (False, "corrupt: checksum mismatch")
    assert not os.path.exists(path)
    assert [n.startswith(key.hex() + ".kv.") for n in
            os.listdir(os.path.join(tier.ns_dir, QUARANTINE_DIR))] == [True]
    stats = tier.stats()
    assert (stats["corrupt"], stats["quarantined"], stats["load_failed"]) == (1, 1, 1)
    tier.close()


def test_restart_indexes_without_rewriting_files(tmp_path, region):
    host, array = region
    first = _open(tmp_path, host)
    keys = [chunk_key(NAMESPACE, i) for i in range(3)]
    for i, key in enumerate(keys):
        array[:70000] = payload(i, 70000)
        assert store(first, key, 0, 70000).ok
    first.close()
    before = {k: os.stat(chunk_path(first.ns_dir, k)) for k in keys}

    second = _open(tmp_path, host)
    assert store(second, keys[0], 0, 70000).ok
    after = {k: os.stat(chunk_path(second.ns_dir, k)) for k in keys}

    assert [(a.st_ino, a.st_mtime_ns) for a in after.values()] == [
        (b.st_ino, b.st_mtime_ns) for b in before.values()]
    assert second.stats()["used_bytes"] == 3 * (4096 + 73728)
    second.close()


def test_other_namespaces_are_left_alone(tmp_path, region):
    host, array = region
    mine = _open(tmp_path, host)
    theirs = _open(tmp_path, host, namespace=OTHER_NAMESPACE)
    their_key = chunk_key(OTHER_NAMESPACE, 1)
    array[:4096] = payload(1, 4096)
    assert store(theirs, their_key, 0, 4096).ok
    their_file = chunk_path(theirs.ns_dir, their_key)
    # a file of the other namespace copied into mine under a name of my namespace
    planted = chunk_path(mine.ns_dir, ChunkKey(NAMESPACE, 1, their_key.block_hash))
    shutil.copy(their_file, planted)
    theirs.close()
    mine.close()

    again = _open(tmp_path, host, max_bytes=4096)  # tiny capacity: would evict if it could
    assert again.lookup(ChunkKey(NAMESPACE, 1, their_key.block_hash)) is Lookup.MISS
    assert again.stats()["chunks"] == 0
    again.close()
    assert os.path.exists(their_file) and os.path.exists(planted)


def test_orphaned_temp_files_are_removed_at_start(tmp_path, region):
    host, _ = region
    _open(tmp_path, host).close()
    tmp_dir = os.path.join(tmp_path, NAMESPACE.hex(), TEMP_DIR)
    key = chunk_key(NAMESPACE, 1).hex()
    dead = os.path.join(tmp_dir, f"{key}.{dead_pid()}.00ff.tmp")
    live = os.path.join(tmp_dir, f"{key}.{os.getpid()}.00fe.tmp")
    ancient_live = os.path.join(tmp_dir, f"{key}.{os.getpid()}.00fd.tmp")
    for path, age_s in ((dead, 60), (live, 60), (ancient_live, 7200)):
        open(path, "wb").close()
        os.utime(path, (time.time() - age_s,) * 2)

    tier = _open(tmp_path, host)
    tier.close()

    assert sorted(os.listdir(tmp_dir)) == [os.path.basename(live)]
    assert tier.stats()["orphaned_temps_removed"] == 2


def test_another_instance_sees_new_and_deleted_chunks_after_refresh(tmp_path, region):
    host, array = region
    writer, reader = _open(tmp_path, host), _open(tmp_path, host)
    key = chunk_key(NAMESPACE, 5)
    array[:4096] = payload(5, 4096)
    assert store(writer, key, 0, 4096).ok
    assert reader.lookup(key) is Lookup.MISS

    reader.refresh()
    assert reader.lookup(key) is Lookup.HIT
    os.unlink(chunk_path(writer.ns_dir, key))
    reader.refresh()

    assert reader.lookup(key) is Lookup.MISS
    writer.close()
    reader.close()


def test_enospc_fails_the_store_evicts_and_serving_continues(tmp_path):
    host, array = host_region(1 << 20)
    with _tiny_tmpfs(1 << 20) as mnt:
        if mnt is None:
            pytest.skip("cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN)")
        tier = _open(mnt, host, max_bytes=1 << 30)
        n = 200 << 10
        keys = [chunk_key(NAMESPACE, i) for i in range(8)]
        results = []
        for i, key in enumerate(keys):  # 1 MiB holds 5 files of 200 KiB + 4 KiB header
            array[:n] = payload(i, n)
            results.append(store(tier, key, 0, n, job_id=i))
            if not results[-1].ok:
                break
        full = len(results) - 1

        assert (full, results[full].error) == (5, "ENOSPC: No space left on device")
        stats = tier.stats()
        assert (stats["enospc"], stats["evictions"], stats["chunks"]) == (1, 2, 3)
        assert [tier.lookup(k) for k in keys[:5]] == [Lookup.MISS] * 2 + [Lookup.HIT] * 3
        array[:n] = payload(99, n)
        assert store(tier, chunk_key(NAMESPACE, 99), 0, n, job_id=99).ok
        assert load(tier, chunk_key(NAMESPACE, 99), n, n, job_id=100).ok
        np.testing.assert_array_equal(array[n:2 * n], payload(99, n))
        assert os.listdir(os.path.join(tier.ns_dir, TEMP_DIR)) == []
        tier.close()


@pytest.mark.parametrize("offset,nbytes", [(-1, 10), (0, 0), ((8 << 20) - 5, 10)])
def test_job_outside_the_host_region_fails_without_raising(tmp_path, region, offset, nbytes):
    tier = _open(tmp_path, region[0])
    results = [store(tier, chunk_key(NAMESPACE, 1), offset, nbytes, job_id=1),
               load(tier, chunk_key(NAMESPACE, 1), offset, nbytes, job_id=2)]
    tier.close()
    assert [(r.ok, r.error) for r in results] == [
        (False, f"slot [{offset}, {offset + nbytes}) outside the host region of "
                f"{8 << 20} bytes")] * 2


def test_key_of_another_namespace_is_refused(tmp_path, region):
    tier = _open(tmp_path, region[0])
    result = store(tier, chunk_key(OTHER_NAMESPACE, 1), 0, 4096)
    tier.close()
    assert (result.ok, result.error) == (False, "key namespace differs from the tier's namespace")


def test_jobs_after_close_fail_once_and_close_is_idempotent(tmp_path, region):
    tier = _open(tmp_path, region[0])
    tier.close()
    tier.close()
    tier.submit_load(TierJob(7, JobKind.LOAD, chunk_key(NAMESPACE, 1), 0, 4096))
    assert [(r.job_id, r.ok, r.error) for r in tier.get_finished_jobs()] == [
        (7, False, "tier closed")]
    assert tier.get_finished_jobs() == []
