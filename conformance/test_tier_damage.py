"""Tier conformance: damaged stored chunks and injected I/O errors.

Damage (bit flip in payload or header, truncation, deletion) of a stored chunk must make
every later load of it fail (a MISS for the engine), never report wrong bytes as loaded.
Injected EACCES / ENOSPC / EIO must fail exactly the affected jobs, each reported once.
"""
from __future__ import annotations

import errno

import numpy as np
import pytest

from kvhal.tier import JobKind, Lookup, TierJob

from .tier_fixtures import chunk_key, load, lookup, payload, run_jobs, store
from .tier_harness import DAMAGE_KINDS, FAULT_ERRNOS

#: Damaged chunks per kind (each with its own seeded damage position).
DAMAGED_CHUNKS = 12


@pytest.mark.parametrize("kind", DAMAGE_KINDS)
def test_damaged_chunk_is_a_miss_every_time(harness, open_tier, namespace, host, kind):
    if kind not in harness.damage_kinds:
        pytest.skip(f"{harness.name} cannot be damaged by {kind}: {harness.why_not}")
    array = np.frombuffer(host, dtype=np.uint8)
    tier = open_tier(host)
    n = 100003
    keys = [chunk_key(namespace, i) for i in range(DAMAGED_CHUNKS)]
    for i, key in enumerate(keys):
        array[:n] = payload(i, n)
        assert store(tier, key, 0, n, job_id=i).ok

    for i, key in enumerate(keys):
        harness.damage(tier, harness.config("", 0) | {}, key, kind, seed=i)
    attempts = run_jobs(tier, [TierJob(100 + 2 * i + r, JobKind.LOAD, k, n, n)
                               for i, k in enumerate(keys) for r in range(2)])

    assert [r.ok for r in attempts.values()] == [False] * (2 * DAMAGED_CHUNKS)
    assert [lookup(tier, k) for k in keys] == [Lookup.MISS] * DAMAGED_CHUNKS


def test_undamaged_chunks_survive_damage_to_others(harness, open_tier, namespace, host):
    if not harness.damage_kinds:
        pytest.skip(f"{harness.name} cannot be damaged: {harness.why_not}")
    array = np.frombuffer(host, dtype=np.uint8)
    tier = open_tier(host)
    n = 8192
    keys = [chunk_key(namespace, i) for i in range(4)]
    for i, key in enumerate(keys):
        array[:n] = payload(i, n)
        assert store(tier, key, 0, n, job_id=i).ok

    harness.damage(tier, {}, keys[1], harness.damage_kinds[-1], seed=0)
    results = [load(tier, k, n * (i + 1), n, job_id=10 + i) for i, k in enumerate(keys)]

    assert [r.ok for r in results] == [True, False, True, True]
    for i in (0, 2, 3):
        np.testing.assert_array_equal(array[n * (i + 1):n * (i + 2)], payload(i, n))


@pytest.mark.parametrize("err", FAULT_ERRNOS, ids=lambda e: errno.errorcode[e])
@pytest.mark.parametrize("direction", ["store", "load"])
def test_injected_io_error_fails_each_job_exactly_once(harness, tmp_path, namespace, host,
                                                       direction, err):
    if harness.faulty is None:
        pytest.skip(f"{harness.name} has no fault injection: {harness.why_not}")
    n = 1 << 20
    keys = [chunk_key(namespace, i) for i in range(5)]
    array = np.frombuffer(host, dtype=np.uint8)
    array[:n] = payload(0, n)
    with harness.faulty(str(tmp_path), err, direction, host, namespace) as tier:
        if direction == "load":  # chunks must exist first; their stores are not faulty
            assert [store(tier, k, 0, n, job_id=i).ok for i, k in enumerate(keys)] == [True] * 5
        kind = JobKind.STORE if direction == "store" else JobKind.LOAD

        results = run_jobs(tier, [TierJob(10 + i, kind, k, n, n) for i, k in enumerate(keys)])

        assert [results[10 + i].ok for i in range(5)] == [False] * 5
        assert all(errno.errorcode[err] in results[10 + i].error for i in range(5))
        assert [lookup(tier, k) for k in keys] == [Lookup.MISS] * 5
