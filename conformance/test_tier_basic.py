"""Tier conformance: round trip, idempotent re-store, absent keys, capacity and LRU eviction,
exactly-once job reporting, restart."""
from __future__ import annotations

import numpy as np
import pytest

from kvhal.tier import JobKind, Lookup, TierJob

from .tier_fixtures import chunk_key, load, lookup, payload, run_jobs, store

#: Chunk sizes of the round trip: tiny, around the 4 KiB page, and a few MiB-scale odd sizes.
SIZES = (1, 4095, 4096, 4097, 65536 + 7, (1 << 20) - 1, 2 << 20, (3 << 20) + 513)


@pytest.mark.parametrize("host_kind", ["pinned", "bytearray"])
def test_round_trip_of_random_chunks(open_tier, namespace, host, host_kind):
    region = host if host_kind == "pinned" else memoryview(bytearray(len(host)))[1:]
    array = np.frombuffer(region, dtype=np.uint8)
    tier = open_tier(region)
    half = len(region) // 2
    offsets = np.cumsum((0,) + SIZES[:-1]).tolist()
    keys = [chunk_key(namespace, i) for i in range(len(SIZES))]
    for i, (off, n) in enumerate(zip(offsets, SIZES)):
        array[off:off + n] = payload(i, n)

    stored = run_jobs(tier, [TierJob(i, JobKind.STORE, k, off, n)
                             for i, (k, off, n) in enumerate(zip(keys, offsets, SIZES))])
    assert [stored[i].ok for i in range(len(SIZES))] == [True] * len(SIZES)
    assert [lookup(tier, k) for k in keys] == [Lookup.HIT] * len(SIZES)
    array[half:] = 0
    loaded = run_jobs(tier, [TierJob(100 + i, JobKind.LOAD, k, half + off, n)
                             for i, (k, off, n) in enumerate(zip(keys, offsets, SIZES))])

    assert [loaded[100 + i].ok for i in range(len(SIZES))] == [True] * len(SIZES)
    for i, (off, n) in enumerate(zip(offsets, SIZES)):
        np.testing.assert_array_equal(array[half + off:half + off + n], payload(i, n))


def test_restore_of_existing_key_succeeds_and_keeps_the_first_bytes(open_tier, namespace, host):
    array = np.frombuffer(host, dtype=np.uint8)
    tier = open_tier(host)
    key, n = chunk_key(namespace, 1), 70000
    array[:n] = payload(1, n)
    array[n:2 * n] = payload(2, n)

    first = store(tier, key, 0, n, job_id=1)
    second = store(tier, key, n, n, job_id=2)
    third = store(tier, key, 0, n, job_id=3)
    back = load(tier, key, 4 * n, n, job_id=4)

    assert (first.ok, second.ok, third.ok, back.ok) == (True, True, True, True)
    np.testing.assert_array_equal(array[4 * n:5 * n], payload(1, n))


def test_absent_key_is_a_miss_and_its_load_fails_once(open_tier, namespace, host):
    tier = open_tier(host)
    key = chunk_key(namespace, 7)

    assert lookup(tier, key) is Lookup.MISS
    result = load(tier, key, 0, 4096, job_id=9)

    assert (result.ok, result.kind, result.key) == (False, JobKind.LOAD, key)
    assert result.error


def test_capacity_keeps_the_most_recent_chunks(harness, open_tier, namespace, host):
    if not harness.own_capacity:
        pytest.skip(f"{harness.name} does not evict by max_bytes: {harness.why_not}")
    n = 64 << 10
    tier = open_tier(host, max_bytes=4 * n + n // 2)
    keys = [chunk_key(namespace, i) for i in range(10)]
    for i, key in enumerate(keys):
        np.frombuffer(host, dtype=np.uint8)[:n] = payload(i, n)
        assert store(tier, key, 0, n, job_id=i).ok

    assert [lookup(tier, k) for k in keys] == [Lookup.MISS] * 6 + [Lookup.HIT] * 4
    for i in range(6, 10):
        assert load(tier, keys[i], n, n, job_id=100 + i).ok
        np.testing.assert_array_equal(np.frombuffer(host, dtype=np.uint8)[n:2 * n],
                                      payload(i, n))


def test_a_load_makes_a_chunk_most_recently_used(harness, open_tier, namespace, host):
    if not harness.own_capacity:
        pytest.skip(f"{harness.name} does not evict by max_bytes: {harness.why_not}")
    n = 64 << 10
    tier = open_tier(host, max_bytes=4 * n + n // 2)
    keys = [chunk_key(namespace, i) for i in range(5)]
    for i in range(4):
        assert store(tier, keys[i], 0, n, job_id=i).ok

    assert load(tier, keys[0], n, n, job_id=10).ok
    assert store(tier, keys[4], 0, n, job_id=4).ok

    assert [lookup(tier, k) for k in keys] == [Lookup.HIT, Lookup.MISS, Lookup.HIT, Lookup.HIT,
                                              Lookup.HIT]


def test_chunk_larger_than_capacity_fails_once_and_is_absent(harness, open_tier, namespace, host):
    if not harness.own_capacity:
        pytest.skip(f"{harness.name} does not evict by max_bytes: {harness.why_not}")
    tier = open_tier(host, max_bytes=64 << 10)
    key = chunk_key(namespace, 3)

    result = store(tier, key, 0, 1 << 20, job_id=5)

    assert (result.ok, result.kind) == (False, JobKind.STORE)
    assert lookup(tier, key) is Lookup.MISS


def test_many_concurrent_jobs_are_each_reported_exactly_once(open_tier, namespace, host):
    tier = open_tier(host)
    n = 256 << 10
    keys = [chunk_key(namespace, i) for i in range(24)]
    stores = [TierJob(i, JobKind.STORE, k, (i % 16) * n, n) for i, k in enumerate(keys)]
    absent = [TierJob(100 + i, JobKind.LOAD, chunk_key(namespace, 1000 + i), 0, n)
              for i in range(8)]

    results = run_jobs(tier, stores + absent)

    assert sorted(i for i, r in results.items() if r.ok) == list(range(24))
    assert sorted(i for i, r in results.items() if not r.ok) == list(range(100, 108))


def test_restart_finds_every_stored_chunk(harness, shared_store, open_tier, namespace, host):
    if not harness.persistent:
        pytest.skip(f"{harness.name} is not persistent: {harness.why_not}")
    array = np.frombuffer(host, dtype=np.uint8)
    first = open_tier(host)
    keys = [chunk_key(namespace, i) for i in range(6)]
    n = 300001
    for i, key in enumerate(keys):
        array[:n] = payload(i, n)
        assert store(first, key, 0, n, job_id=i).ok
        harness.after_store(first, harness.config(shared_store, 0), key, n)
    first.close()

    second = open_tier(host)

    assert [lookup(second, k) for k in keys] == [Lookup.HIT] * 6
    for i, key in enumerate(keys):
        assert load(second, key, n, n, job_id=10 + i).ok
        np.testing.assert_array_equal(array[n:2 * n], payload(i, n))


@pytest.mark.parametrize("offset,nbytes", [(-1, 10), (0, 0), (None, 10)],
                         ids=["negative-offset", "empty", "past-the-end"])
def test_job_outside_the_host_region_fails_without_raising(open_tier, namespace, host, offset,
                                                           nbytes):
    offset = len(host) - 5 if offset is None else offset
    tier = open_tier(host)
    results = [store(tier, chunk_key(namespace, 1), offset, nbytes, job_id=1),
               load(tier, chunk_key(namespace, 1), offset, nbytes, job_id=2)]
    assert [(r.ok, r.error) for r in results] == [
        (False, f"slot [{offset}, {offset + nbytes}) outside the host region of "
                f"{len(host)} bytes")] * 2


def test_key_of_another_namespace_is_refused(open_tier, namespace, host):
    tier = open_tier(host)
    other = bytes(b ^ 0xFF for b in namespace)
    result = store(tier, chunk_key(other, 1), 0, 4096)
    assert (result.ok, result.error) == (False, "key namespace differs from the tier's namespace")
