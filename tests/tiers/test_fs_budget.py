"""The fs tier's max_bytes covers every namespace under root_dir: namespaces nobody uses are
deleted first, namespaces in use shrink this one's budget."""
from __future__ import annotations

import os
import time

import pytest

from kvhal.tier import JobKind, Lookup, TierJob
from kvhal.tiers.fs import FsTier
from kvhal.tiers.fs.budget import IN_USE_FILE, MIN_STALE_S
from kvhal.tiers.fs.ledger import USAGE_FILE

from .helpers import (NAMESPACE, OTHER_NAMESPACE, FaultyPausedOs, chunk_key, host_region,
                      payload, store, wait_for)

#: File bytes of a 4096-byte chunk (header page + payload).
FILE = 8192


@pytest.fixture
def region():
    return host_region()


def _fill(root, host, array, namespace, count, **config) -> FsTier:
    tier = FsTier({"root_dir": str(root), "refresh_interval_s": 3600} | config, host, namespace)
    for i in range(count):
        array[:4096] = payload(i, 4096)
        assert store(tier, chunk_key(namespace, i), 0, 4096).ok
    return tier


def _held(tier: FsTier) -> int:
    """Bytes the namespace of `tier` holds on disk: its chunk files, in-use marker and usage
    ledger."""
    return tier.stats()["used_bytes"] + sum(os.path.getsize(os.path.join(tier.ns_dir, name))
                                            for name in (IN_USE_FILE, USAGE_FILE))


def _age(tier: FsTier, seconds: float) -> None:
    marker = os.path.join(tier.ns_dir, IN_USE_FILE)
    then = time.time() - seconds
    os.utime(marker, (then, then))


def test_a_namespace_nobody_uses_is_deleted_before_own_chunks(tmp_path, region):
    host, array = region
    old = _fill(tmp_path, host, array, OTHER_NAMESPACE, 3)
    old.close()
    _age(old, 2 * 3600 * 10)                       # 10 of its refresh intervals ago, twice over
    new = _fill(tmp_path, host, array, NAMESPACE, 4, max_bytes=5 * FILE)

    assert not os.path.exists(old.ns_dir)
    assert [new.lookup(chunk_key(NAMESPACE, i)) for i in range(4)] == [Lookup.HIT] * 4
    stats = new.stats()
    assert (stats["namespaces_deleted"], stats.get("evictions", 0), stats["used_bytes"],
            stats["other_namespaces_bytes"]) == (1, 0, 4 * FILE, 0)
    new.close()


def test_a_namespace_in_use_is_kept_and_counts_against_the_budget(tmp_path, region):
    host, array = region
    other = _fill(tmp_path, host, array, OTHER_NAMESPACE, 3)
    _age(other, MIN_STALE_S / 2)                   # marked within the stale limit: in use
    other_bytes = _held(other)
    new = _fill(tmp_path, host, array, NAMESPACE, 4, max_bytes=2 * FILE + other_bytes + 64)

    assert [other.lookup(chunk_key(OTHER_NAMESPACE, i)) for i in range(3)] == [Lookup.HIT] * 3
    assert [new.lookup(chunk_key(NAMESPACE, i)) for i in range(4)] == [Lookup.MISS] * 2 + [
        Lookup.HIT] * 2
    stats = new.stats()
    assert (stats.get("namespaces_deleted", 0), stats["evictions"], stats["used_bytes"],
            stats["other_namespaces_bytes"]) == (0, 2, 2 * FILE, other_bytes)
    other.close()
    new.close()


def test_a_chunk_that_fits_only_without_namespaces_in_use_fails_naming_them(tmp_path, region):
    host, array = region
    other = _fill(tmp_path, host, array, OTHER_NAMESPACE, 2)
    held = _held(other)
    new = FsTier({"root_dir": str(tmp_path), "max_bytes": FILE + held - 1}, host, NAMESPACE)

    result = store(new, chunk_key(NAMESPACE, 0), 0, 4096)
    assert (result.ok, result.error) == (False, f"chunk file of {FILE} bytes exceeds max_bytes "
                                         f"{FILE + held - 1} less {held} bytes held by other "
                                         "namespaces in use")
    other.close()
    new.close()


@pytest.mark.parametrize("others", [False, True], ids=["alone", "other-namespace-in-use"])
def test_a_store_in_flight_keeps_a_second_one_from_taking_the_tier_past_max_bytes(tmp_path,
                                                                                    region,
                                                                                    others):
    host, array = region
    other = _fill(tmp_path, host, array, OTHER_NAMESPACE, 2) if others else None
    held = _held(other) if others else 0
    array[:2 * 4096] = payload(7, 2 * 4096)
    osm = FaultyPausedOs("pwritev")
    tier = FsTier({"root_dir": str(tmp_path), "refresh_interval_s": 3600,
                   "max_bytes": FILE + FILE // 2 + held, "n_write_threads": 2}, host, NAMESPACE,
                  os_module=osm)
    first, second = chunk_key(NAMESPACE, 1), chunk_key(NAMESPACE, 2)
    tier.submit_store(TierJob(1, JobKind.STORE, first, 0, 4096))
    assert osm.paused.wait(30)

    tier.submit_store(TierJob(2, JobKind.STORE, second, 4096, 4096))
    results = []
    wait_for(lambda: results.extend(tier.get_finished_jobs()) or results, what="job 2's result")
    refused = results[0]
    osm.resume.set()
    tier.drain(30)

    assert refused.job_id == 2
    why = (f" (max_bytes {FILE + FILE // 2 + held} less {held} bytes held by other namespaces "
           "in use)" if others else "")
    assert (refused.ok, refused.error) == (False, f"chunk file: {FILE} bytes do not fit in "
                                           f"max_bytes {FILE + FILE // 2} while stores in flight "
                                           f"hold {FILE} bytes{why}")
    assert [r.ok for r in tier.get_finished_jobs()] == [True]
    assert (tier.stats()["used_bytes"], tier.stats()["refused_in_flight"]) == (FILE, 1)
    assert store(tier, second, 4096, 4096).ok          # with nothing in flight: evicts the first
    assert [tier.lookup(first), tier.lookup(second)] == [Lookup.MISS, Lookup.HIT]
    assert tier.stats()["used_bytes"] == FILE
    tier.close()
    if other is not None:
        other.close()
