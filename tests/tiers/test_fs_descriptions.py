"""The fs tier keeps each chunk's description (`TierJob.description`) beside its folders and
hands what a listing finds back with it (`take_found`): a restarted instance announces its disk
with token ids and parents, older folders still load, torn logs lose only their tail."""
from __future__ import annotations

import glob
import os

import pytest

from kvhal.tier import JobKind, TierJob
from kvhal.tiers.fs import FsTier
from kvhal.tiers.fs import descriptions
from kvhal.tiers.fs.descriptions import DESCRIPTIONS_DIR, MAGIC, read_records
from kvhal.tiers.fs.format import chunk_path

from .helpers import NAMESPACE, chunk_key, dead_pid, host_region, payload, run_jobs

NBYTES = 4096


@pytest.fixture
def region():
    return host_region()


def _open(root, host) -> FsTier:
    return FsTier({"root_dir": str(root), "refresh_interval_s": 3600}, host, NAMESPACE)


def _store(tier, array, described: dict[int, bytes | None]) -> None:
    jobs = []
    for i, description in described.items():
        array[i * NBYTES:(i + 1) * NBYTES] = payload(i, NBYTES)
        jobs.append(TierJob(i, JobKind.STORE, chunk_key(NAMESPACE, i), i * NBYTES, NBYTES,
                            description=description))
    assert all(r.ok for r in run_jobs(tier, jobs).values())


def _logs(tier) -> list[str]:
    return sorted(glob.glob(os.path.join(tier.ns_dir, DESCRIPTIONS_DIR, "*.log")))


def test_a_restarted_tier_finds_every_chunk_with_its_description(tmp_path, region):
    """Fails when descriptions are not persisted (found with None) or found chunks are not
    handed out (a restarted instance announces nothing: the issue's restart)."""
    host, array = region
    tier = _open(tmp_path, host)
    assert tier.take_found() == []                     # an empty folder holds nothing
    _store(tier, array, {0: b"zero", 1: b"one", 2: None})
    assert tier.take_found() == []                     # its own stores are not "found"
    tier.close()
    again = _open(tmp_path, host)
    try:
        found = dict(again.take_found())
        assert found == {chunk_key(NAMESPACE, 0): b"zero", chunk_key(NAMESPACE, 1): b"one",
                         chunk_key(NAMESPACE, 2): None}
        assert again.take_found() == []                # each once
        # a store of a chunk already on disk adds its description (stored before without)
        _store(again, array, {2: b"two"})
    finally:
        again.close()
    third = _open(tmp_path, host)
    try:
        assert dict(third.take_found())[chunk_key(NAMESPACE, 2)] == b"two"
    finally:
        third.close()


def test_a_folder_without_logs_or_with_another_version_loads_undescribed(tmp_path, region):
    """Chunk folders of an older kvhal (no descriptions) and logs of another format version
    load: every chunk is found, without a description."""
    host, array = region
    tier = _open(tmp_path, host)
    _store(tier, array, {0: b"zero", 1: b"one"})
    tier.close()
    for log in _logs(tier):
        with open(log, "r+b") as f:
            f.write(b"KVHALD9\n")
    again = _open(tmp_path, host)
    try:
        assert dict(again.take_found()) == {chunk_key(NAMESPACE, 0): None,
                                            chunk_key(NAMESPACE, 1): None}
    finally:
        again.close()


def test_a_torn_log_keeps_the_records_before_the_tear(tmp_path, region):
    """A crash that cuts the last record (or leaves garbage after it) loses that record's
    description only. Fails when a torn record is taken (wrong bytes) or ends all reading."""
    host, array = region
    tier = _open(tmp_path, host)
    _store(tier, array, {0: b"zero" * 50, 1: b"one" * 50})
    tier.close()
    (log,) = _logs(tier)
    size = os.path.getsize(log)
    with open(log, "r+b") as f:
        f.truncate(size - 7)                          # the last record torn
    again = _open(tmp_path, host)
    try:
        found = dict(again.take_found())
    finally:
        again.close()
    assert sorted(found.values(), key=str) == [None, b"zero" * 50] or sorted(
        found.values(), key=str) == [None, b"one" * 50]
    with open(_logs(again)[0], "ab") as f:             # garbage after whole records
        f.write(b"\xff" * 11)
    third = _open(tmp_path, host)
    try:
        assert sorted(v is not None for v in dict(third.take_found()).values()) == [False, True]
    finally:
        third.close()


def test_start_folds_the_logs_and_drops_deleted_chunks(tmp_path, region):
    """At start one log is left (the logs of writers that are gone are folded into it and
    deleted), without the records of chunks no longer on disk: logs do not grow across
    restarts."""
    host, array = region
    tier = _open(tmp_path, host)
    _store(tier, array, {i: b"d%d" % i for i in range(4)})
    tier.close()
    stale = os.path.join(tier.ns_dir, DESCRIPTIONS_DIR, f"{dead_pid()}.00.log")
    with open(stale, "wb") as f:                     # a dead writer's log
        f.write(MAGIC)
    os.unlink(chunk_path(tier.ns_dir, chunk_key(NAMESPACE, 3)))
    again = _open(tmp_path, host)
    try:
        assert len(dict(again.take_found())) == 3
        (log,) = _logs(again)
        records, _ = read_records(log)
        assert sorted(block_hash for _, _, block_hash, _ in records) == sorted(
            chunk_key(NAMESPACE, i).block_hash for i in range(3))
    finally:
        again.close()


def test_chunks_another_process_stores_are_found_with_their_description(tmp_path, region):
    """Two tiers on one root (a shared folder): what one stores, the other's listing finds,
    with the description the writer recorded."""
    host, array = region
    reader = _open(tmp_path, host)
    writer = _open(tmp_path, host)
    try:
        _store(writer, array, {5: b"five"})
        reader.refresh()
        assert reader.take_found() == [(chunk_key(NAMESPACE, 5), b"five")]
    finally:
        writer.close()
        reader.close()


def test_a_running_tier_rewrites_its_log_once_most_records_are_of_chunks_gone(
        tmp_path, region, monkeypatch):
    """A long run's log does not grow without bound: once more of its records name chunks no
    longer held than held ones, a listing rewrites it with the live ones. Fails without
    `prune` (6 records stay)."""
    monkeypatch.setattr(descriptions, "FOLD_MIN", 2)
    host, array = region
    tier = _open(tmp_path, host)
    try:
        _store(tier, array, {i: b"d%d" % i for i in range(6)})
        for i in range(1, 6):
            os.unlink(chunk_path(tier.ns_dir, chunk_key(NAMESPACE, i)))
        tier.refresh()                                 # the listing loses 5 of 6 chunks
        (log,) = _logs(tier)
        records, _ = read_records(log)
        assert [block_hash for _, _, block_hash, _ in records] == [
            chunk_key(NAMESPACE, 0).block_hash]
        _store(tier, array, {7: b"seven"})             # appends go to the new file
    finally:
        tier.close()
    again = _open(tmp_path, host)
    try:
        assert dict(again.take_found()) == {chunk_key(NAMESPACE, 0): b"d0",
                                            chunk_key(NAMESPACE, 7): b"seven"}
    finally:
        again.close()


_DISK_FULL = r"""
import os, resource, signal, sys
from kvhal.keys import ChunkKey
from kvhal.tiers.fs.descriptions import DescriptionLogs, MAGIC, encode_record
folder, ns = sys.argv[1], bytes(range(16))
key = lambda i: ChunkKey(ns, 0, bytes([i]) * 32)
logs = DescriptionLogs(folder, ns)
logs.open([])
logs.append(key(0), b"a" * 100)                       # the log: MAGIC + record 0
full = len(MAGIC) + len(encode_record(key(0), b"a" * 100))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (full + 50, hard))   # the disk fills mid-record
logs.append(key(1), b"b" * 100)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))        # space freed again
logs.append(key(2), b"c" * 100)
logs.close()
"""


def test_a_record_cut_by_a_full_disk_does_not_hide_the_later_ones(tmp_path):
    """A write cut short (the file size limit: what a full disk does to a `write`) leaves a
    torn record; fails when it is left in the log, where it ends every later reading of the
    records appended after it (their chunks then restart undescribed)."""
    import subprocess
    import sys
    subprocess.run([sys.executable, "-c", _DISK_FULL, str(tmp_path)], check=True, timeout=60)
    (log,) = glob.glob(str(tmp_path / DESCRIPTIONS_DIR / "*.log"))
    records, end = read_records(log)
    assert [(r[2][:1], r[3]) for r in records] == [(b"\x00", 100), (b"\x02", 100)]
    assert end == os.path.getsize(log)


_FULL_AT_START = r"""
import resource, signal, sys
from tests.tiers.test_fs_descriptions import _open
from tests.tiers.helpers import NAMESPACE, chunk_key, host_region
host, _ = host_region()
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (30, resource.RLIM_INFINITY))   # no room to fold
tier = _open(sys.argv[1], host)
assert dict(tier.take_found()) == {chunk_key(NAMESPACE, 0): b"zero" * 20,
                                   chunk_key(NAMESPACE, 1): b"one" * 20}, "found"
tier.close()
"""


def test_a_full_disk_at_start_keeps_the_tier_and_its_descriptions(tmp_path, region):
    """A restart on a full disk (the file size limit: the fold of the logs cannot be
    written). Fails when the fs tier then refuses to start ("cannot list"), when the chunks
    are found without their descriptions, or when the cut temp file is left behind."""
    import subprocess
    import sys
    host, array = region
    tier = _open(tmp_path, host)
    _store(tier, array, {0: b"zero" * 20, 1: b"one" * 20})
    tier.close()
    subprocess.run([sys.executable, "-c", _FULL_AT_START, str(tmp_path)], check=True,
                   timeout=60, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                       os.path.abspath(__file__)))))
    assert not glob.glob(str(tmp_path / "*" / DESCRIPTIONS_DIR / "*.tmp"))
    again = _open(tmp_path, host)      # room again: the records are all still there
    try:
        assert dict(again.take_found()) == {chunk_key(NAMESPACE, 0): b"zero" * 20,
                                            chunk_key(NAMESPACE, 1): b"one" * 20}
    finally:
        again.close()


def test_a_huge_log_is_read_in_bounded_memory(tmp_path):
    """A long-lived fleet's fs root holds logs of hundreds of MB; each start (and each
    listing that finds chunks) reads them. Fails when a log is read whole into memory (here
    64 MiB of records; the reading may hold a few MiB at a time)."""
    import tracemalloc

    from kvhal.keys import ChunkKey
    from kvhal.tiers.fs.descriptions import encode_record
    log = tmp_path / "huge.log"
    with open(log, "wb") as f:
        f.write(MAGIC)
        for i in range(64):
            f.write(encode_record(ChunkKey(NAMESPACE, 0, i.to_bytes(32, "big")),
                                  bytes([i]) * ((1 << 20) - 64)))
    tracemalloc.start()
    try:
        records, end = read_records(str(log))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(records) == 64 and end == os.path.getsize(log)
    assert [r[2] for r in records] == [i.to_bytes(32, "big") for i in range(64)]
    assert peak < 16 << 20, f"{peak / 2**20:.0f} MiB held to read a 64 MiB log"
