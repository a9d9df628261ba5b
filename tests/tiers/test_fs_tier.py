"""fs tier behaviour beyond the conformance suite: files, quarantine, restart, namespaces,
orphaned temp files, ENOSPC, O_DIRECT detection, bad jobs."""
from __future__ import annotations

import errno
import os
import stat
import resource
import shutil
import threading
import time

import numpy as np
import pytest

from conformance.tier_harness import _tiny_tmpfs
from kvhal.keys import ChunkKey
from kvhal.tier import JobKind, Lookup, TierError, TierJob
from kvhal.tiers.chunk_format import ALIGN
from kvhal.tiers.fs import FsTier
from kvhal.tiers.fs.direct import SMALL_CHUNK_BYTES
from kvhal.tiers.fs.fileio import probe_o_direct
from kvhal.tiers.fs.format import QUARANTINE_DIR, chunk_path
from kvhal.tiers.fs.large_io import WINDOW

from .helpers import (NAMESPACE, OTHER_NAMESPACE, FaultyPausedOs, chunk_key, dead_pid, host_region,
                      load, payload, store, temp_files)


@pytest.fixture
def region():
    return host_region()


def _open(root, host, namespace=NAMESPACE, **config) -> FsTier:
    return FsTier({"root_dir": str(root), "refresh_interval_s": 3600} | config, host, namespace)


def _store_chunks(tier, array, count, nbytes) -> list[ChunkKey]:
    """Store chunks 0..count-1 of `nbytes` (payload i) through slot 0; returns their keys."""
    keys = [chunk_key(NAMESPACE, i) for i in range(count)]
    for i, key in enumerate(keys):
        array[:nbytes] = payload(i, nbytes)
        assert store(tier, key, 0, nbytes).ok
    return keys


@pytest.mark.parametrize("o_direct", ["auto", False, "small", "small-writes"])
def test_o_direct_is_detected_and_reported(tmp_path, region, o_direct):
    tier = _open(tmp_path, region[0], o_direct=o_direct)
    tier.close()
    supported = probe_o_direct(str(tmp_path))
    expected = o_direct == "auto" and supported
    writes = SMALL_CHUNK_BYTES if o_direct in ("small", "small-writes") and supported else 0
    reads = SMALL_CHUNK_BYTES if o_direct == "small" and supported else 0
    assert (tier.o_direct, tier.stats()["o_direct"]) == (expected, expected)
    assert tier.o_direct_writes_below == tier.stats()["o_direct_writes_below"] == writes
    assert tier.o_direct_reads_below == tier.stats()["o_direct_reads_below"] == reads


def _spy_direct(monkeypatch) -> list[tuple[str, int, bool]]:
    """Record (function, payload bytes, `direct`) of each chunk the tier writes or reads, one
    by one (write_chunk / read_chunk) or in a batch (write_chunks / read_chunks: one entry per
    chunk, named as the single call), then do the I/O."""
    import kvhal.tiers.fs.tier as fs_tier

    calls = []
    for name in ("write_chunk", "read_chunk"):
        real = getattr(fs_tier, name)

        def spy(*args, _real=real, _name=name):
            calls.append((_name, len(args[3]), args[4] if _name == "write_chunk" else args[5]))
            return _real(*args)
        monkeypatch.setattr(fs_tier, name, spy)
    # (argument holding the jobs, index of the payload in a job)
    for name, at, payload in (("write_chunks", 1, 1), ("read_chunks", 0, 2)):
        real = getattr(fs_tier, name)

        def batch_spy(*args, _real=real, _name=name[:-1], _at=at, _payload=payload):
            calls.extend((_name, len(job[_payload]), job[_payload + 1]) for job in args[_at])
            return _real(*args)
        monkeypatch.setattr(fs_tier, name, batch_spy)
    return calls


@pytest.mark.parametrize("o_direct", [None, "small", "small-writes"],
                         ids=["default", "small", "small-writes"])
def test_small_chunks_alone_use_o_direct_by_default_and_small_writes_only_to_write(
        tmp_path, monkeypatch, o_direct):
    if not probe_o_direct(str(tmp_path)):
        pytest.skip(f"{tmp_path}: the filesystem refuses O_DIRECT")
    calls = _spy_direct(monkeypatch)
    host, array = host_region(4 << 20)
    array[:] = np.random.default_rng(3).integers(0, 256, len(array), dtype=np.uint8)
    tier = _open(tmp_path, host, **({} if o_direct is None else {"o_direct": o_direct}))
    small, large = SMALL_CHUNK_BYTES // 4, 2 * SMALL_CHUNK_BYTES
    try:
        for i, nbytes in enumerate((small, large)):
            assert store(tier, chunk_key(NAMESPACE, i), 0, nbytes).ok
            assert load(tier, chunk_key(NAMESPACE, i), 0, nbytes).ok
    finally:
        tier.close()
    # "adaptive" (the default) writes its first large chunk with O_DIRECT (`large_io.py`)
    # and reads every large one with O_DIRECT
    assert calls == [("write_chunk", small, True),
                     ("read_chunk", small, o_direct != "small-writes"),
                     ("write_chunk", large, o_direct is None),
                     ("read_chunk", large, o_direct is None)]


@pytest.mark.parametrize("fast_io", [True, False], ids=["c", "python"])
@pytest.mark.parametrize("durability", ["process", "power-loss"])
def test_small_chunks_at_the_threshold_and_unaligned_read_back_into_another_slot(
        tmp_path, monkeypatch, fast_io, durability):
    # payloads just under / at SMALL_CHUNK_BYTES, ragged tails, host offsets O_DIRECT cannot
    # take (buffered fallback); each read back into another, aligned and zeroed slot (with
    # O_DIRECT below the threshold, a ragged tail through the scratch block), also after a
    # restart, and by fsck
    from kvhal.tiers.fs import fileio
    from kvhal.tiers.fs.check import check_dir

    if not probe_o_direct(str(tmp_path)):
        pytest.skip(f"{tmp_path}: the filesystem refuses O_DIRECT")
    if not fast_io:
        monkeypatch.setattr(fileio, "_chunkio", None)
    elif not fileio.FAST_IO:
        pytest.skip("kvhal.tiers.fs._chunkio was not built")
    calls = _spy_direct(monkeypatch)
    host, array = host_region(4 << 20)
    array[:2 << 20] = np.random.default_rng(5).integers(0, 256, 2 << 20, dtype=np.uint8)
    cases = [(1, 0), (4097, 0), (SMALL_CHUNK_BYTES - 1, 0), (SMALL_CHUNK_BYTES, 0),
             (5000, 1), (5000, 512)]
    tier = _open(tmp_path, host, durability=durability, o_direct="small")
    try:
        for i, (nbytes, offset) in enumerate(cases):
            assert store(tier, chunk_key(NAMESPACE, i), offset, nbytes).ok
    finally:
        tier.close()
    assert [c[2] for c in calls] == [True, True, True, False, False, False]
    calls.clear()
    tier = _open(tmp_path, host, durability=durability, o_direct="small")
    try:
        assert tier.stats()["chunks"] == len(cases)
        for i, (nbytes, offset) in enumerate(cases):
            array[2 << 20:] = 0
            assert load(tier, chunk_key(NAMESPACE, i), 2 << 20, nbytes).ok
            assert np.array_equal(array[2 << 20:(2 << 20) + nbytes],
                                  array[offset:offset + nbytes]), (nbytes, offset)
    finally:
        tier.close()
    assert [c[2] for c in calls] == [True, True, True, False, True, True]
    report = check_dir(str(tmp_path))
    assert (report.good, report.corrupt) == (len(cases), 0)


def test_small_writes_are_buffered_where_the_filesystem_refuses_o_direct(tmp_path, region,
                                                                         monkeypatch):
    import kvhal.tiers.fs.tier as fs_tier

    monkeypatch.setattr(fs_tier, "probe_o_direct", lambda folder: False)
    calls = _spy_direct(monkeypatch)
    tier = _open(tmp_path, region[0])
    try:
        assert (tier.o_direct, tier.o_direct_writes_below) == (False, 0)
        assert tier.stats()["o_direct_writes_below"] == 0
        assert store(tier, chunk_key(NAMESPACE, 0), 0, ALIGN).ok
    finally:
        tier.close()
    assert calls == [("write_chunk", ALIGN, False)]
    with pytest.raises(TierError, match="o_direct: true, but the filesystem"):
        _open(tmp_path, region[0], o_direct=True)


def _one_stored_chunk(tier, array, seed: int) -> tuple[ChunkKey, str]:
    """Store chunk `seed` (5000 bytes of payload `seed`, through slot 0): its key and path."""
    key = chunk_key(NAMESPACE, seed)
    array[:5000] = payload(seed, 5000)
    assert store(tier, key, 0, 5000).ok
    return key, chunk_path(tier.ns_dir, key)


def test_a_corrupt_chunk_is_quarantined_and_counted(tmp_path, region):
    host, array = region
    tier = _open(tmp_path, host)
    key, path = _one_stored_chunk(tier, array, 1)
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
    keys = _store_chunks(first, array, 3, 70000)
    first.close()
    before = {k: os.stat(chunk_path(first.ns_dir, k)) for k in keys}

    second = _open(tmp_path, host)
    assert store(second, keys[0], 0, 70000).ok
    after = {k: os.stat(chunk_path(second.ns_dir, k)) for k in keys}

    assert [(a.st_ino, a.st_mtime_ns) for a in after.values()] == [
        (b.st_ino, b.st_mtime_ns) for b in before.values()]
    assert second.stats()["used_bytes"] == 3 * (4096 + 73728)
    second.close()



def test_a_chunk_file_replaced_by_another_keys_valid_file_is_a_miss(tmp_path, region):
    host, array = region
    tier = _open(tmp_path, host)
    victim, other = chunk_key(NAMESPACE, 1), chunk_key(NAMESPACE, 2)
    for i, key in ((1, victim), (2, other)):
        array[:5000] = payload(i, 5000)
        assert store(tier, key, 0, 5000).ok
    victim_path = chunk_path(tier.ns_dir, victim)
    shutil.copy(chunk_path(tier.ns_dir, other), victim_path)  # valid header and checksum
    array[8192:13192] = 0

    result = load(tier, victim, 8192, 5000)

    assert (result.ok, result.error) == (False, "corrupt: record holds another key than its "
                                                "name says")
    assert tier.lookup(victim) is Lookup.MISS and not os.path.exists(victim_path)
    assert load(tier, other, 16384, 5000).ok
    np.testing.assert_array_equal(array[16384:21384], payload(2, 5000))
    tier.close()
    shutil.copy(chunk_path(tier.ns_dir, other), victim_path)  # and again, seen at restart
    again = _open(tmp_path, host)
    assert (again.lookup(victim), again.lookup(other)) == (Lookup.MISS, Lookup.HIT)
    again.close()



def test_a_fifo_under_a_chunk_name_never_blocks_start_or_loads(tmp_path, region):
    host, array = region
    tier = _open(tmp_path, host, o_direct=False)               # O_DIRECT refuses FIFOs anyway
    planted, served = chunk_key(NAMESPACE, 1), chunk_key(NAMESPACE, 2)
    array[:5000] = payload(2, 5000)
    assert store(tier, served, 0, 5000).ok
    os.mkfifo(chunk_path(tier.ns_dir, planted))              # no writer: a blocking open hangs
    os.unlink(chunk_path(tier.ns_dir, served))
    os.mkfifo(chunk_path(tier.ns_dir, served))               # replaces an indexed chunk

    result = load(tier, served, 8192, 5000)

    assert (result.ok, result.error) == (False, "corrupt: not a regular file (mode prw-r--r--)")
    assert not os.path.exists(chunk_path(tier.ns_dir, served))
    tier.close()
    started: list[FsTier] = []
    opener = threading.Thread(target=lambda: started.append(_open(tmp_path, host,
                                                                  o_direct=False)), daemon=True)
    opener.start()
    opener.join(60)
    assert len(started) == 1, "start blocked on a FIFO"
    assert (started[0].lookup(planted), started[0].stats()["chunks"]) == (Lookup.MISS, 0)
    started[0].close()


def test_a_load_that_missed_keeps_the_chunk_a_store_wrote_meanwhile(tmp_path, region):
    # the load finds no file, then a store of the same chunk writes and indexes it, then the
    # load ends: forgetting the chunk would leave its file out of used_bytes, and the next
    # store would not evict for it (found by a stress run: +3.5% over max_bytes)
    from kvhal.tiers.chunk_format import record_nbytes

    host, array = region
    nbytes = 3 * ALIGN
    tier = _open(tmp_path, host, max_bytes=2 * record_nbytes(nbytes))
    a, b, c, d = (chunk_key(NAMESPACE, i) for i in range(1, 5))
    for i, key in enumerate((a, b)):
        array[:nbytes] = payload(i, nbytes)
        assert store(tier, key, 0, nbytes).ok
    missed, resume = threading.Event(), threading.Event()
    real_read = tier._read

    def read_then_wait(job, path):
        try:
            return real_read(job, path)
        except FileNotFoundError:
            missed.set()
            assert resume.wait(30)
            raise
    tier._read = read_then_wait
    outcome: list[str | None] = []
    loader = threading.Thread(target=lambda: outcome.append(
        tier._load(TierJob(9, JobKind.LOAD, c, 4 * ALIGN, nbytes))))
    try:
        loader.start()
        assert missed.wait(30)
        array[:nbytes] = payload(3, nbytes)
        assert store(tier, c, 0, nbytes).ok                    # evicts a
        resume.set()
        loader.join(30)
        array[:nbytes] = payload(4, nbytes)
        assert store(tier, d, 0, nbytes).ok                    # must evict b
        tier.refresh()
        stats = tier.stats()
        indexed = [key in tier._index for key in (a, b, c, d)]
        on_disk = [os.path.exists(chunk_path(tier.ns_dir, key)) for key in (a, b, c, d)]
    finally:
        resume.set()
        tier.close()

    assert outcome == ["not found"]
    assert indexed == on_disk == [False, False, True, True]
    assert stats["used_bytes"] == stats["max_bytes"] == 2 * record_nbytes(nbytes)


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_what_o_direct_cannot_open_under_a_chunk_name_is_quarantined(tmp_path, region, kind):
    # O_DIRECT refuses a FIFO or a directory with EINVAL: that is what took the name, not an
    # I/O error that would fail every load of the key forever
    if not probe_o_direct(str(tmp_path)):
        pytest.skip(f"{tmp_path}: the filesystem refuses O_DIRECT")
    host, array = region
    tier = _open(tmp_path, host)
    key, path = _one_stored_chunk(tier, array, 2)
    os.unlink(path)
    os.mkfifo(path) if kind == "fifo" else os.mkdir(path)
    mode = stat.filemode(os.lstat(path).st_mode)

    result = load(tier, key, 8192, 5000)
    stats = tier.stats()
    tier.close()

    assert mode[0] == ("p" if kind == "fifo" else "d")
    assert (result.ok, result.error) == (False, f"corrupt: not a regular file (mode {mode})")
    assert not os.path.lexists(path)
    assert os.listdir(os.path.join(tier.ns_dir, QUARANTINE_DIR)) != []
    assert (stats.get("quarantined"), stats.get("io_errors", 0)) == (1, 0)


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
    key = chunk_key(NAMESPACE, 1).hex()
    tmp_dir = os.path.dirname(chunk_path(os.path.join(tmp_path, NAMESPACE.hex()),
                                         chunk_key(NAMESPACE, 1)))
    dead = os.path.join(tmp_dir, f"{key}.{dead_pid()}.00ff.tmp")
    live = os.path.join(tmp_dir, f"{key}.{os.getpid()}.00fe.tmp")
    ancient_live = os.path.join(tmp_dir, f"{key}.{os.getpid()}.00fd.tmp")
    for path, age_s in ((dead, 60), (live, 60), (ancient_live, 7200)):
        open(path, "wb").close()
        os.utime(path, (time.time() - age_s,) * 2)

    tier = _open(tmp_path, host)
    tier.close()

    assert temp_files(os.path.join(tmp_path, NAMESPACE.hex())) == [live]
    assert tier.stats()["orphaned_temps_removed"] == 2


def test_a_running_tier_removes_temp_files_of_a_writer_that_died_at_its_next_refresh(
        tmp_path, region):
    # a writer sharing root_dir dies mid-write while this tier runs on: its temp files used
    # to stay until this tier restarted
    host, _ = region
    tier = _open(tmp_path, host)
    key = chunk_key(NAMESPACE, 1)
    folder = os.path.dirname(chunk_path(tier.ns_dir, key))
    dead = os.path.join(folder, f"{key.hex()}.{dead_pid()}.00ff.tmp")
    live = os.path.join(folder, f"{key.hex()}.{os.getpid()}.00fe.tmp")
    for path in (dead, live):
        with open(path, "wb") as f:
            f.write(b"x" * 100)
        os.utime(path, (time.time() - 60,) * 2)

    tier.refresh()

    assert temp_files(tier.ns_dir) == [live]
    assert (tier.stats()["orphaned_temps_removed"], tier.stats()["chunks"]) == (1, 0)
    tier.close()


def test_temp_names_with_impossible_pids_and_legacy_temp_files_are_orphans(tmp_path, region):
    # a pid beyond any C long used to raise OverflowError out of the tier's start (and fsck);
    # temp files in <ns>/tmp/, where earlier versions wrote them, were never removed again
    host, _ = region
    _open(tmp_path, host).close()
    ns_dir = os.path.join(tmp_path, NAMESPACE.hex())
    key = chunk_key(NAMESPACE, 1)
    folder = os.path.dirname(chunk_path(ns_dir, key))
    os.makedirs(os.path.join(ns_dir, "tmp"))
    huge = os.path.join(folder, f"{key.hex()}.{10 ** 30}.00ff.tmp")
    zero = os.path.join(folder, f"{key.hex()}.0.00fe.tmp")
    legacy_dead = os.path.join(ns_dir, "tmp", f"{key.hex()}.{dead_pid()}.00fd.tmp")
    legacy_live = os.path.join(ns_dir, "tmp", f"{key.hex()}.{os.getpid()}.00fc.tmp")
    for path in (huge, zero, legacy_dead, legacy_live):
        with open(path, "wb") as f:
            f.write(b"x" * 100)
        os.utime(path, (time.time() - 60,) * 2)

    tier = _open(tmp_path, host)
    tier.close()

    assert tier.stats()["orphaned_temps_removed"] == 3
    assert temp_files(ns_dir) == []
    assert os.listdir(os.path.join(ns_dir, "tmp")) == [os.path.basename(legacy_live)]


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



def test_a_chunk_evicted_while_being_read_is_served_once_and_stays_evicted(tmp_path, region):
    host, array = region
    faulty = FaultyPausedOs("preadv")
    tier = FsTier({"root_dir": str(tmp_path), "refresh_interval_s": 3600,
                   "max_bytes": 4096 + 8192}, host, NAMESPACE, os_module=faulty)
    old, new = chunk_key(NAMESPACE, 1), chunk_key(NAMESPACE, 2)
    array[:8192] = payload(1, 8192)
    assert store(tier, old, 0, 8192).ok
    tier.submit_load(TierJob(10, JobKind.LOAD, old, 8192, 8192))
    assert faulty.paused.wait(30)
    array[:8192] = payload(2, 8192)
    tier.submit_store(TierJob(11, JobKind.STORE, new, 0, 8192))    # evicts old mid-read
    results, deadline = [], time.monotonic() + 30
    while not results and time.monotonic() < deadline:             # the store ends first
        results = tier.get_finished_jobs()
    faulty.resume.set()
    tier.drain(30)

    results += tier.get_finished_jobs()
    assert [(r.job_id, r.ok) for r in results] == [(11, True), (10, True)]
    assert not os.path.exists(chunk_path(tier.ns_dir, old))        # the open file was intact
    np.testing.assert_array_equal(array[8192:16384], payload(1, 8192))
    assert (tier.lookup(old), tier.lookup(new)) == (Lookup.MISS, Lookup.HIT)
    stats = tier.stats()
    assert (stats["chunks"], stats["used_bytes"], stats["evictions"]) == (1, 4096 + 8192, 1)
    tier.close()


def test_a_folder_that_cannot_be_listed_keeps_the_index(tmp_path, region):
    host, array = region
    tier = _open(tmp_path, host)
    keys = _store_chunks(tier, array, 3, 4096)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = os.open(os.devnull, os.O_RDONLY)             # open() takes the lowest free fd
    os.close(lowest_free)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))  # no fd can be opened
    try:
        with pytest.raises(OSError) as err:                      # EMFILE: no fd for scandir
            tier.refresh()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    assert err.value.errno == errno.EMFILE
    assert [tier.lookup(k) for k in keys] == [Lookup.HIT] * 3
    assert (tier.stats()["chunks"], tier.stats()["used_bytes"]) == (3, 3 * 8192)
    tier.close()


def test_enospc_fails_the_store_evicts_and_serving_continues(tmp_path):
    host, array = host_region(1 << 20)
    with _tiny_tmpfs(1 << 20) as mnt:
        if mnt is None:
            pytest.skip("cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN)")
        tier = _open(mnt, host, max_bytes=1 << 30)
        n = 196 << 10
        keys = [chunk_key(NAMESPACE, i) for i in range(8)]
        results = []
        # 1 MiB holds 5 files of 196 KiB + 4 KiB header beside the in-use marker and the
        # usage ledger (4 KiB each), not 6
        for i, key in enumerate(keys):
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
        assert temp_files(tier.ns_dir) == []
        tier.close()


def test_jobs_after_close_fail_once_and_close_is_idempotent(tmp_path, region):
    tier = _open(tmp_path, region[0])
    tier.close()
    tier.close()
    tier.submit_load(TierJob(7, JobKind.LOAD, chunk_key(NAMESPACE, 1), 0, 4096))
    assert [(r.job_id, r.ok, r.error) for r in tier.get_finished_jobs()] == [
        (7, False, "tier closed")]
    assert tier.get_finished_jobs() == []


def _needs_batches():
    from kvhal.tiers.fs import fileio

    if not fileio.HASH_IN_C:
        pytest.skip("kvhal.tiers.fs._chunkio was not built, or python-xxhash's C hashers "
                    "could not be bound: no batches")


def test_a_load_batch_reads_the_batchable_jobs_in_one_call_and_sorts_out_each_failure(
        tmp_path, monkeypatch):
    # one batch: a good chunk, a corrupt one, a missing one, a ragged one (not batchable: read
    # alone), a job outside the host region; each gets the outcome it gets alone
    _needs_batches()
    host, array = host_region(8 << 20)
    tier = _open(tmp_path, host)
    chunk = 64 * ALIGN
    keys = [chunk_key(NAMESPACE, i) for i in range(4)]
    try:
        for i, (key, nbytes) in enumerate(zip(keys, (chunk, chunk, chunk, 5000))):
            array[:nbytes] = payload(i, nbytes)
            assert store(tier, key, 0, nbytes).ok
        del keys[2:3]
        missing = chunk_key(NAMESPACE, 99)
        with open(chunk_path(tier.ns_dir, keys[1]), "r+b") as f:
            f.seek(2 * ALIGN)
            f.write(b"\xff\x00\xff")
        calls = _spy_direct(monkeypatch)
        array[:] = 0
        jobs = [TierJob(0, JobKind.LOAD, keys[0], 0, chunk),
                TierJob(1, JobKind.LOAD, keys[1], chunk, chunk),
                TierJob(2, JobKind.LOAD, missing, 2 * chunk, chunk),
                TierJob(3, JobKind.LOAD, keys[2], 3 * chunk, 5000),
                TierJob(4, JobKind.LOAD, keys[0], len(host) - ALIGN, chunk)]
        outcomes = tier._load_batch(jobs)
        stats = tier.stats()
        corrupt_forgotten = tier.lookup(keys[1]) is Lookup.MISS
    finally:
        tier.close()

    assert outcomes[0] is None and outcomes[3] is None
    assert outcomes[1] == "corrupt: checksum mismatch"
    assert outcomes[2] == "not found"
    assert outcomes[4] == (f"slot [{len(host) - ALIGN}, {len(host) - ALIGN + chunk}) outside the "
                           f"host region of {len(host)} bytes")
    assert corrupt_forgotten
    assert np.array_equal(array[:chunk], payload(0, chunk))
    assert np.array_equal(array[3 * chunk:3 * chunk + 5000], payload(3, 5000))
    # the batch read jobs 0-2 at once; the corrupt and missing ones were read again alone,
    # then the ragged one (the job outside the host region reads nothing)
    assert [c[:2] for c in calls] == [("read_chunk", chunk)] * 5 + [("read_chunk", 5000)]
    assert (stats["corrupt"], stats["quarantined"], stats["missing"]) == (1, 1, 1)
    assert stats["bytes_loaded"] == chunk + 5000
    assert os.listdir(os.path.join(tier.ns_dir, QUARANTINE_DIR))


def test_a_store_batch_writes_the_batchable_jobs_in_one_call_and_keeps_the_budget(tmp_path):
    # one batch: two new chunks, one already stored, a ragged one (written alone), one larger
    # than max_bytes, one outside the host region; each ends as it does alone and every
    # reservation ends (used_bytes counts exactly the files written)
    _needs_batches()
    from kvhal.tiers.chunk_format import record_nbytes

    host, array = host_region(8 << 20)
    chunk = 64 * ALIGN
    tier = _open(tmp_path, host, max_bytes=8 * record_nbytes(chunk))
    keys = [chunk_key(NAMESPACE, i) for i in range(5)]
    try:
        for i in range(4):
            array[i * chunk:(i + 1) * chunk] = payload(i, chunk)
        assert store(tier, keys[2], 2 * chunk, chunk).ok
        jobs = [TierJob(0, JobKind.STORE, keys[0], 0, chunk),
                TierJob(1, JobKind.STORE, keys[1], chunk, chunk),
                TierJob(2, JobKind.STORE, keys[2], 2 * chunk, chunk),
                TierJob(3, JobKind.STORE, keys[3], 3 * chunk, 5000),
                TierJob(4, JobKind.STORE, keys[4], 0, 9 * chunk),
                TierJob(5, JobKind.STORE, keys[4], len(host), chunk)]
        outcomes = tier._store_batch(jobs)
        stats = tier.stats()
        array[:] = 0
        reads = [load(tier, key, i * chunk, chunk if i != 3 else 5000).ok
                 for i, key in enumerate(keys[:4])]
    finally:
        tier.close()

    assert outcomes[:4] == [None] * 4
    assert "exceeds max_bytes" in outcomes[4]
    assert outcomes[5] == f"slot [{len(host)}, {len(host) + chunk}) outside the host region of " \
                          f"{len(host)} bytes"
    assert reads == [True] * 4
    for i in range(3):
        assert np.array_equal(array[i * chunk:(i + 1) * chunk], payload(i, chunk))
    assert stats["used_bytes"] == 3 * record_nbytes(chunk) + record_nbytes(5000)
    assert stats["chunks"] == 4
    assert stats["bytes_stored"] == 3 * chunk + 5000


def test_adaptive_large_writes_try_both_modes_and_every_large_read_is_o_direct(tmp_path,
                                                                              monkeypatch):
    # one window of each mode for writes (`large_io.py`): O_DIRECT first, then buffered; the
    # files of both read back bit-exact, every one with O_DIRECT
    if not probe_o_direct(str(tmp_path)):
        pytest.skip(f"{tmp_path}: the filesystem refuses O_DIRECT")
    calls = _spy_direct(monkeypatch)
    host, array = host_region(8 << 20)
    nbytes, n = SMALL_CHUNK_BYTES, 2 * WINDOW
    array[:4 * nbytes] = np.random.default_rng(9).integers(0, 256, 4 * nbytes, dtype=np.uint8)
    expected = array[:4 * nbytes].copy()
    tier = _open(tmp_path, host)
    try:
        for i in range(n):
            assert store(tier, chunk_key(NAMESPACE, i), i % 4 * nbytes, nbytes).ok
        loaded = []
        for i in range(n):
            array[:4 * nbytes] = 0
            assert load(tier, chunk_key(NAMESPACE, i), i % 4 * nbytes, nbytes).ok
            loaded.append(np.array_equal(array[i % 4 * nbytes:(i % 4 + 1) * nbytes],
                                         expected[i % 4 * nbytes:(i % 4 + 1) * nbytes]))
        stats = tier.stats()
    finally:
        tier.close()

    assert loaded == [True] * n
    assert [c[2] for c in calls if c[0] == "write_chunk"] == [True] * WINDOW + [False] * WINDOW
    assert [c[2] for c in calls if c[0] == "read_chunk"] == [True] * n
    assert (stats["large_writes_o_direct"], stats["large_writes_buffered"]) == (WINDOW, WINDOW)
    assert stats["large_write_o_direct_gbps"] > 0 and stats["large_write_buffered_gbps"] > 0
    assert not any(name.startswith(("large_reads", "large_read_")) for name in stats)


def test_a_malformed_job_fails_alone_in_a_store_batch_and_holds_no_room(tmp_path):
    # a job whose checks raise (no key) gets its own internal error; its neighbours are stored
    # and every reservation ends (used_bytes is exactly the files written)
    _needs_batches()
    from kvhal.tiers.chunk_format import record_nbytes

    host, array = host_region(8 << 20)
    chunk = 16 * ALIGN
    tier = _open(tmp_path, host, max_bytes=4 * record_nbytes(chunk))
    try:
        jobs = [TierJob(0, JobKind.STORE, chunk_key(NAMESPACE, 0), 0, chunk),
                TierJob(1, JobKind.STORE, None, chunk, chunk),
                TierJob(2, JobKind.STORE, chunk_key(NAMESPACE, 2), 2 * chunk, chunk)]
        outcomes = tier._store_batch(jobs)
        after = [store(tier, chunk_key(NAMESPACE, 10 + i), 0, chunk).ok for i in range(4)]
        stats = tier.stats()
    finally:
        tier.close()

    assert outcomes[0] is None and outcomes[2] is None
    assert outcomes[1].startswith("internal error: AttributeError: ")
    assert after == [True] * 4          # no leaked reservation refuses them
    assert stats["used_bytes"] == 4 * record_nbytes(chunk) == stats["max_bytes"]


def test_a_refresh_during_a_store_batch_leaves_its_files_to_the_batch(tmp_path, monkeypatch):
    # the batch's files are renamed into place before their reservations end: a refresh then
    # must not index them (it would count them twice, and an eviction meanwhile would leave
    # an indexed chunk with no file)
    _needs_batches()
    import kvhal.tiers.fs.tier as fs_tier
    from kvhal.tiers.chunk_format import record_nbytes

    host, array = host_region(8 << 20)
    chunk = 16 * ALIGN
    tier = _open(tmp_path, host)
    seen = []
    real = fs_tier.write_chunks

    def write_then_refresh(*args):
        outcomes = real(*args)
        tier.refresh()
        seen.append((tier.stats()["chunks"], len(glob_chunks(tier.ns_dir))))
        return outcomes
    monkeypatch.setattr(fs_tier, "write_chunks", write_then_refresh)
    try:
        jobs = [TierJob(i, JobKind.STORE, chunk_key(NAMESPACE, i), i * chunk, chunk)
                for i in range(4)]
        assert tier._store_batch(jobs) == [None] * 4
        stats = tier.stats()
    finally:
        tier.close()

    assert seen == [(0, 4)]            # 4 files on disk, none indexed by the refresh
    assert (stats["chunks"], stats["used_bytes"]) == (4, 4 * record_nbytes(chunk))


def glob_chunks(ns_dir: str) -> list[str]:
    import glob

    from kvhal.tiers.fs.format import CHUNK_SUFFIX

    return glob.glob(os.path.join(ns_dir, "chunks", "*", f"*{CHUNK_SUFFIX}"))
