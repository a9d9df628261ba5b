"""`max_bytes` holds for a namespace folder several processes share (`tiers/fs/ledger.py`):
real processes, each with its own `FsTier` on one root_dir, storing at once."""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys

import pytest

from conformance.tier_harness import FaultyOs
from kvhal.tier import JobKind, TierJob
from kvhal.tiers.fs import FsTier
from kvhal.tiers.fs.fileio import Scratch, write_chunk
from kvhal.tiers.fs.check import check_dir
from kvhal.tiers.fs.ledger import USAGE_FILE, Ledger, read_usage
from kvhal.tiers.fs.scan import scan_namespace

from .helpers import NAMESPACE, chunk_key, host_region, kv_bytes, payload, store

#: File bytes of a 4096-byte chunk (header page + payload).
FILE = 8192
MAX_BYTES = 24 * FILE
WORKERS = 3
ROUNDS = 60


def _start_workers(root: str, go: str) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-m", "tests.tiers.fs_shared_worker", root,
                              str(MAX_BYTES), str(w * 100_000), str(ROUNDS), go],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for w in range(WORKERS)]


def test_processes_sharing_a_namespace_folder_keep_it_within_max_bytes(tmp_path):
    root, go = str(tmp_path / "root"), str(tmp_path / "go")
    workers = _start_workers(root, go)
    open(go, "w").close()
    reports = []
    for worker in workers:
        stdout, stderr = worker.communicate(timeout=300)
        assert worker.returncode == 0, stderr
        reports.append(json.loads(stdout.strip().splitlines()[-1]))

    ns_dir = os.path.join(root, NAMESPACE.hex())
    samples = [s for r in reports for s in r["samples"]]
    assert len(samples) == WORKERS * ROUNDS
    assert max(samples) <= MAX_BYTES, f"over max_bytes {MAX_BYTES}: {max(samples)}"
    assert kv_bytes(ns_dir) <= MAX_BYTES
    # the run filled the folder, most stores and some loads succeeded, none read wrong bytes
    assert max(samples) >= MAX_BYTES - 4 * FILE
    assert sum(r["stores_ok"] for r in reports) >= WORKERS * ROUNDS * 3
    assert sum(r["loads_ok"] for r in reports) > 0
    assert sum(r["wrong_bytes"] for r in reports) == 0
    # with every process gone the ledger's total is the folder's bytes (the next opening
    # rescans), and fsck finds nothing amiss beside the ledger
    host, _ = host_region()
    tier = FsTier({"root_dir": root, "max_bytes": MAX_BYTES}, host, NAMESPACE)
    assert tier.stats()["namespace_bytes"] == kv_bytes(ns_dir)
    tier.close()
    report = check_dir(root)
    assert (report.corrupt, report.other_files, report.orphaned_temps) == (0, 0, 0)


def test_a_writer_killed_mid_store_leaves_its_reservation_until_the_next_rescan(tmp_path):
    host, array = host_region()
    tier = FsTier({"root_dir": str(tmp_path), "max_bytes": MAX_BYTES,
                   "refresh_interval_s": 3600}, host, NAMESPACE)
    array[:4096] = payload(1, 4096)
    assert store(tier, chunk_key(NAMESPACE, 1), 0, 4096).ok
    # a second process reserves a store, then hangs in its write and is killed
    child = subprocess.Popen([sys.executable, "-m", "tests.tiers.fs_paused_writer",
                              str(tmp_path), str(MAX_BYTES)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "paused"
        assert read_usage(tier.ns_dir).total == 2 * FILE     # its reservation counts
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    finally:
        child.kill()
        child.wait()
    assert read_usage(tier.ns_dir).total == 2 * FILE         # still: nobody rescanned yet
    assert kv_bytes(tier.ns_dir) == FILE

    tier.refresh()
    assert read_usage(tier.ns_dir).total == FILE             # re-based to the folder's bytes
    assert tier.stats()["namespace_bytes"] == FILE
    tier.close()


def test_files_of_an_older_kvhal_without_a_ledger_are_counted_at_first_open(tmp_path):
    host, array = host_region()
    tier = FsTier({"root_dir": str(tmp_path), "max_bytes": 3 * FILE}, host, NAMESPACE)
    for i in range(3):
        array[:4096] = payload(i, 4096)
        assert store(tier, chunk_key(NAMESPACE, i), 0, 4096).ok
    tier.close()
    os.unlink(os.path.join(tier.ns_dir, USAGE_FILE))

    ledger = Ledger(tier.ns_dir, lambda: kv_bytes(tier.ns_dir))
    assert read_usage(tier.ns_dir).total == 3 * FILE
    ledger.close()


@pytest.mark.parametrize("recycle", [True, False], ids=["recycle", "unlink"])
def test_a_store_into_a_full_namespace_keeps_the_ledger_equal_to_the_files(tmp_path, recycle):
    host, array = host_region()
    tier = FsTier({"root_dir": str(tmp_path), "max_bytes": 3 * FILE, "recycle_files": recycle,
                   "refresh_interval_s": 3600}, host, NAMESPACE)
    for i in range(8):
        array[:4096] = payload(i, 4096)
        assert store(tier, chunk_key(NAMESPACE, i), 0, 4096).ok
        assert read_usage(tier.ns_dir).total == kv_bytes(tier.ns_dir) <= 3 * FILE
    assert tier.stats().get("files_recycled", 0) == (5 if recycle else 0)
    tier.close()


@pytest.mark.parametrize("recycle", [True, False], ids=["recycle", "unlink"])
def test_a_store_of_a_chunk_another_process_wrote_counts_its_file_once(tmp_path, recycle):
    host, array = host_region()
    config = {"root_dir": str(tmp_path), "max_bytes": 4 * FILE, "refresh_interval_s": 3600,
              "recycle_files": recycle}
    first = FsTier(config, host, NAMESPACE)
    second = FsTier(config, host, NAMESPACE)
    array[:4096] = payload(5, 4096)
    assert store(first, chunk_key(NAMESPACE, 5), 0, 4096).ok
    assert store(second, chunk_key(NAMESPACE, 5), 0, 4096).ok   # unindexed there: rewritten
    assert kv_bytes(first.ns_dir) == read_usage(first.ns_dir).total == FILE
    assert second.stats().get("files_recycled", 0) == int(recycle)
    first.close()
    second.close()


def test_a_reservation_is_given_back_when_its_write_fails(tmp_path):
    host, array = host_region()
    tier = FsTier({"root_dir": str(tmp_path), "max_bytes": 4 * FILE}, host, NAMESPACE,
                  os_module=FaultyOs(errno.EIO, ("pwritev",)))
    array[:4096] = payload(0, 4096)
    assert store(tier, chunk_key(NAMESPACE, 0), 0, 4096).error == "EIO: Input/output error"
    usage = read_usage(tier.ns_dir)
    assert (usage.total, usage.pending) == (0, 0)
    tier.close()


def test_a_store_that_finishes_while_a_rescan_lists_the_folder_is_counted_once(tmp_path):
    # the steps of a refresh interleaved with a store: the committed sum is taken, the store
    # finishes, the listing finds its file; counting the store again would cost its room
    host, array = host_region()
    tier = FsTier({"root_dir": str(tmp_path), "max_bytes": 4 * FILE,
                   "refresh_interval_s": 3600}, host, NAMESPACE)
    ledger = tier._ledger
    mark = ledger.mark()
    array[:4096] = payload(1, 4096)
    assert store(tier, chunk_key(NAMESPACE, 1), 0, 4096).ok
    scan = scan_namespace(tier.ns_dir, NAMESPACE, {})
    ledger.rebase(mark, scan.chunk_bytes, scan.found)
    assert read_usage(tier.ns_dir).total == kv_bytes(tier.ns_dir) == FILE
    tier.close()


def test_a_store_whose_file_a_rescan_lists_before_it_commits_is_counted_once(tmp_path):
    # a refresh lists the folder between a store's rename and its commit
    host, array = host_region()
    tier = FsTier({"root_dir": str(tmp_path), "max_bytes": 4 * FILE,
                   "refresh_interval_s": 3600}, host, NAMESPACE)
    key = chunk_key(NAMESPACE, 1)
    array[:4096] = payload(1, 4096)
    job = TierJob(1, JobKind.STORE, key, 0, 4096)
    reservation = tier._store_begin(job)
    write_chunk(os, tier.ns_dir, key, tier._payload(job), False, Scratch(), False)
    tier.refresh()                                   # lists the file, the store in flight
    assert read_usage(tier.ns_dir).total == kv_bytes(tier.ns_dir) == FILE
    assert tier._store_end(job, reservation, None) is None
    assert read_usage(tier.ns_dir).total == kv_bytes(tier.ns_dir) == FILE
    tier.close()
