"""A full fs tier overwrites an evicted chunk file in place instead of deleting it and creating
a new one (`recycle_files`), on the C and the Python path, and never serves its old or mixed
bytes: not to a load of this tier, not to another process's reader that had it open."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

from kvhal.tier import JobKind, Lookup, TierError, TierJob
from kvhal.tiers.chunk_format import ALIGN, record_nbytes
from kvhal.tiers.fs import FsTier
from kvhal.tiers.fs.fileio import Scratch, read_chunk, write_chunk
from kvhal.tiers.fs.format import chunk_path

from .helpers import (NAMESPACE, FaultyPausedOs, PassThroughOs, chunk_key, host_region, payload,
                      store, temp_files)

NBYTES = 3 * ALIGN
RECORD = record_nbytes(NBYTES)


@pytest.fixture
def region():
    return host_region(1 << 20)


def _full_tier(root, host, os_module=os, **config):
    """A tier that holds two chunks of NBYTES: the third store evicts."""
    return FsTier({"root_dir": str(root), "refresh_interval_s": 3600, "max_bytes": 2 * RECORD}
                  | config, host, NAMESPACE, os_module=os_module)


def _fill(tier, array, seeds):
    keys = []
    for seed in seeds:
        array[:NBYTES] = payload(seed, NBYTES)
        keys.append(chunk_key(NAMESPACE, seed))
        assert store(tier, keys[-1], 0, NBYTES).ok
    return keys


def _load_ok(tier, array, key, seed) -> bool:
    array[ALIGN:ALIGN + NBYTES] = 0
    tier.submit_load(TierJob(99, JobKind.LOAD, key, ALIGN, NBYTES))
    tier.drain(30)
    ok = [r.ok for r in tier.get_finished_jobs()] == [True]
    return ok and np.array_equal(array[ALIGN:ALIGN + NBYTES], payload(seed, NBYTES))


@pytest.mark.parametrize("os_module", [os, PassThroughOs()], ids=["c", "python"])
def test_a_store_into_a_full_tier_overwrites_the_evicted_file_in_place(tmp_path, region,
                                                                        os_module):
    host, array = region
    tier = _full_tier(tmp_path, host, os_module)
    old, kept = _fill(tier, array, [1, 2])
    with open(chunk_path(tier.ns_dir, old), "rb") as probe:   # holds the victim's inode
        (new,) = _fill(tier, array, [3])
        assert not os.path.exists(chunk_path(tier.ns_dir, old))
        with open(chunk_path(tier.ns_dir, new), "rb") as f:
            assert probe.read() == f.read() and os.fstat(probe.fileno()).st_size == RECORD
    assert _load_ok(tier, array, new, 3) and _load_ok(tier, array, kept, 2)
    assert (tier.lookup(old), tier.lookup(new)) == (Lookup.MISS, Lookup.HIT)
    stats = tier.stats()
    assert (stats["evictions"], stats["files_recycled"], stats["chunks"]) == (1, 1, 2)
    assert stats["used_bytes"] == 2 * RECORD and temp_files(tier.ns_dir) == []
    tier.close()


@pytest.mark.parametrize("config, nbytes", [({"recycle_files": False}, NBYTES),
                                            ({"durability": "power-loss"}, NBYTES),
                                            ({}, NBYTES - ALIGN)],
                         ids=["recycle_files-false", "power-loss", "other-size"])
def test_no_recycling_without_it_under_power_loss_or_for_another_size(tmp_path, region,
                                                                      config, nbytes):
    host, array = region
    tier = _full_tier(tmp_path, host, **config)
    old, _ = _fill(tier, array, [1, 2])
    with open(chunk_path(tier.ns_dir, old), "rb") as f:
        before = f.read()
    probe = open(chunk_path(tier.ns_dir, old), "rb")
    array[:nbytes] = payload(3, nbytes)
    new = chunk_key(NAMESPACE, 3)
    assert store(tier, new, 0, nbytes).ok

    with probe:
        assert probe.read() == before                    # deleted, not overwritten
    assert not os.path.exists(chunk_path(tier.ns_dir, old))
    assert "files_recycled" not in tier.stats() and tier.stats()["evictions"] >= 1
    array[ALIGN:ALIGN + nbytes] = 0
    tier.submit_load(TierJob(9, JobKind.LOAD, new, ALIGN, nbytes))
    tier.drain(30)
    assert [r.ok for r in tier.get_finished_jobs()] == [True]
    assert np.array_equal(array[ALIGN:ALIGN + nbytes], payload(3, nbytes))
    tier.close()


def test_recycle_files_must_be_a_boolean(tmp_path, region):
    with pytest.raises(TierError, match=r"^recycle_files: must be true or false, got 1$"):
        FsTier({"root_dir": str(tmp_path), "recycle_files": 1}, region[0], NAMESPACE)


def _paused_reader_races(tmp_path, region, seeds):
    """Two tiers on one folder, as two processes: the reader opens the chunk of seed 1 and is
    paused before reading it while the full writer stores `seeds` (the first recycles that
    very file). Returns (writer, reader, the reader's host array, its finished jobs)."""
    host, array = region
    reader_host, reader_array = host_region(1 << 20)
    writer = _full_tier(tmp_path, host)
    old, _ = _fill(writer, array, [1, 2])
    faulty = FaultyPausedOs("preadv")
    reader = FsTier({"root_dir": str(tmp_path), "refresh_interval_s": 3600}, reader_host,
                    NAMESPACE, os_module=faulty)
    reader.submit_load(TierJob(10, JobKind.LOAD, old, 0, NBYTES))
    assert faulty.paused.wait(30)
    _fill(writer, array, seeds)
    assert writer.stats()["files_recycled"] == len(seeds)
    faulty.resume.set()
    reader.drain(30)
    return writer, reader, reader_array, reader.get_finished_jobs()


def test_another_readers_open_file_recycled_under_it_is_a_miss_not_corruption(tmp_path,
                                                                               region):
    writer, reader, _, results = _paused_reader_races(tmp_path, region, [3])

    assert [(r.job_id, r.ok, r.error) for r in results] == [(10, False, "not found")]
    stats = reader.stats()
    assert (stats.get("corrupt", 0), stats.get("quarantined", 0), stats["missing"]) == (0, 0, 1)
    assert _load_ok(writer, region[1], chunk_key(NAMESPACE, 3), 3)   # not quarantined
    writer.close()
    reader.close()


def test_a_file_replaced_under_a_reader_by_a_new_copy_of_its_chunk_is_read_again(tmp_path,
                                                                                 region):
    # seed 3 recycles the reader's file, then seed 1 is stored anew: the first read fails its
    # checks, the path names another file now, and that one is served
    writer, reader, reader_array, results = _paused_reader_races(tmp_path, region, [3, 1])

    assert [(r.job_id, r.ok) for r in results] == [(10, True)]
    assert np.array_equal(reader_array[:NBYTES], payload(1, NBYTES))
    stats = reader.stats()
    assert (stats.get("corrupt", 0), stats.get("quarantined", 0)) == (0, 0)
    assert os.path.exists(chunk_path(writer.ns_dir, chunk_key(NAMESPACE, 1)))
    writer.close()
    reader.close()


def _plant(path, kind, outside):
    """Put a FIFO, a symlink to `outside` or a second hard link `outside` at `path`."""
    if kind == "fifo":
        os.unlink(path)
        os.mkfifo(path)
    elif kind == "symlink":
        os.rename(path, outside)
        os.symlink(outside, path)
    else:
        os.link(path, outside)


@pytest.mark.parametrize("os_module", [os, PassThroughOs()], ids=["c", "python"])
@pytest.mark.parametrize("kind", ["fifo", "symlink", "hardlink"])
def test_a_victim_that_is_not_a_lone_regular_file_is_deleted_not_recycled(tmp_path, region,
                                                                         kind, os_module):
    host, array = region
    tier = _full_tier(tmp_path / "tier", host, os_module)
    old, kept = _fill(tier, array, [1, 2])
    outside = tmp_path / "outside"
    _plant(chunk_path(tier.ns_dir, old), kind, outside)
    before = None if kind == "fifo" else outside.read_bytes()
    (new,) = _fill(tier, array, [3])                     # returns: a FIFO never blocks it

    assert not os.path.lexists(chunk_path(tier.ns_dir, old))
    if before is not None:
        assert outside.read_bytes() == before            # the file outside is untouched
    assert "files_recycled" not in tier.stats()
    assert _load_ok(tier, array, new, 3) and _load_ok(tier, array, kept, 2)
    assert temp_files(tier.ns_dir) == []
    tier.close()


class TempMtimeOs(PassThroughOs):
    """`os`, recording the mtime of every file renamed to a temp name (`*.tmp`). Injects
    nothing."""

    def __init__(self):
        self.temp_mtimes = []

    def rename(self, src, dst):
        os.rename(src, dst)
        if dst.endswith(".tmp"):
            self.temp_mtimes.append(os.stat(dst).st_mtime)


def test_a_recycled_file_takes_its_temp_name_with_a_fresh_mtime(tmp_path, region):
    # a temp file's age is its mtime (orphan removal): an evicted file written an hour ago
    # must not look like an hour-old temp file of a dead writer
    host, array = region
    spy = TempMtimeOs()
    tier = _full_tier(tmp_path, host, spy)
    old, _ = _fill(tier, array, [1, 2])
    os.utime(chunk_path(tier.ns_dir, old), (1.0e9, 1.0e9))       # written long ago
    before = time.time()
    _fill(tier, array, [3])

    assert tier.stats()["files_recycled"] == 1
    assert len(spy.temp_mtimes) == 1 and spy.temp_mtimes[0] >= before - 1
    tier.close()


def test_a_file_damaged_at_rest_is_quarantined(tmp_path, region):
    host, array = region
    tier = _full_tier(tmp_path, host)
    (key,) = _fill(tier, array, [1])
    path = chunk_path(tier.ns_dir, key)
    with open(path, "r+b") as f:
        f.seek(RECORD - 1)
        f.write(b"\xff")
    tier.submit_load(TierJob(5, JobKind.LOAD, key, ALIGN, NBYTES))
    tier.drain(30)
    (result,) = tier.get_finished_jobs()
    assert not result.ok and result.error.startswith("corrupt")
    assert (tier.stats()["corrupt"], tier.stats()["quarantined"]) == (1, 1)
    assert not os.path.exists(path)
    tier.close()


def test_a_listing_that_saw_a_recycled_victim_does_not_index_it_after_the_store(tmp_path,
                                                                               region):
    # the steps of a refresh interleaved with a recycling store, in the order that used to
    # count the victim twice: a refresh while the store runs (it skips the victim, in
    # `_storing`), a listing begun before the victim's file is renamed, merged after the store
    # ended. The victim's file is gone: indexing it would put used_bytes over max_bytes.
    host, array = region
    tier = _full_tier(tmp_path, host)
    first, second = _fill(tier, array, [1, 2])
    array[:NBYTES] = payload(3, NBYTES)
    job = TierJob(0, JobKind.STORE, chunk_key(NAMESPACE, 3), 0, NBYTES)
    try:
        reservation = tier._store_begin(job)
        # recycles the LRU chunk's file
        assert (reservation.nbytes, reservation.reuse) == (RECORD, first)
        tier.refresh()
        _, epoch = tier._index.snapshot()
        listed = {first: RECORD, second: RECORD}                # the listing saw both files
        assert tier._write_alone(job, reservation) is None
        tier._index.reconcile(listed, epoch)
        stats = tier.stats()
        indexed = [key in tier._index for key in (first, second, job.key)]
    finally:
        tier.close()

    assert not os.path.exists(chunk_path(tier.ns_dir, first))
    assert indexed == [False, True, True]
    assert (stats["used_bytes"], stats["max_bytes"]) == (2 * RECORD, 2 * RECORD)


@pytest.mark.parametrize("os_module", [os, PassThroughOs()], ids=["c", "python"])
def test_write_chunk_recycles_a_longer_file_and_creates_when_the_file_is_gone(tmp_path,
                                                                               os_module):
    host, array = host_region(1 << 20)
    for i in range(256):
        os.makedirs(tmp_path / "chunks" / f"{i:02x}", exist_ok=True)
    ns_dir = str(tmp_path)
    spare = tmp_path / "spare"
    spare.write_bytes(b"\xaa" * (RECORD + 5 * ALIGN))              # longer than the record
    key = chunk_key(NAMESPACE, 4)
    array[:NBYTES] = payload(4, NBYTES)
    assert write_chunk(os_module, ns_dir, key, host[:NBYTES], False, Scratch(), False,
                       str(spare)) is True
    assert not spare.exists() and os.path.getsize(chunk_path(ns_dir, key)) == RECORD
    array[ALIGN:] = 0
    read_chunk(os, chunk_path(ns_dir, key), key, host[ALIGN:ALIGN + NBYTES], NAMESPACE, False,
               Scratch())
    assert np.array_equal(array[ALIGN:ALIGN + NBYTES], payload(4, NBYTES))

    other = chunk_key(NAMESPACE, 5)
    assert write_chunk(os_module, ns_dir, other, host[:NBYTES], False, Scratch(), False,
                       str(spare)) is False                        # gone: a new file
    assert os.path.getsize(chunk_path(ns_dir, other)) == RECORD
    assert temp_files(ns_dir) == []
