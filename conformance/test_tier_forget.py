"""Tier conformance: a failed load heals the tier's index (`SecondaryTier.forget`).

Whatever made a tier unable to serve chunk k of a prefix (files or objects deleted, a lost
segment, a peer that no longer holds them) likely took the later chunks too. The engine then
calls `forget(keys[k:])`; from then on lookups of keys[k:] settle to MISS while keys[:k] stay
HIT, and storing keys[k:] again really writes them (the tier's `bytes_stored` grows by exactly
their bytes, also where the store still holds a record it cannot serve), after which every
chunk of the prefix loads back byte-exact.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from kvhal.tier import JobKind, Lookup, SecondaryTier, TierJob

from .tier_fixtures import chunk_key, load, lookup, payload, run_jobs, store

#: Chunks of the test prefix, and the first one the tier loses.
PREFIX_CHUNKS = 6
FIRST_LOST = 2
#: Payload bytes per chunk (not a multiple of 4 KiB: records are padded).
NBYTES = 8191
#: Seconds lookups may take to settle after `forget` (a healthy tier needs milliseconds).
SETTLE_TIMEOUT_S = 10.0


def _store_prefix(tier: SecondaryTier, array: np.ndarray, keys, first_job: int) -> list[bool]:
    """Store chunk i of `keys` with payload `payload(i, NBYTES)`, one job at a time."""
    ok = []
    for i, key in enumerate(keys):
        array[:NBYTES] = payload(i, NBYTES)
        ok.append(store(tier, key, 0, NBYTES, job_id=first_job + i).ok)
    return ok


def _lookups_once_settled(tier: SecondaryTier, keys, expected: list[Lookup]) -> list[Lookup]:
    """The lookups of `keys` once they equal `expected`, or as they are after
    `SETTLE_TIMEOUT_S`."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    answers = [lookup(tier, k) for k in keys]
    while answers != expected and time.monotonic() < deadline:
        time.sleep(0.01)
        answers = [lookup(tier, k) for k in keys]
    return answers


def _load_prefix(tier: SecondaryTier, array: np.ndarray, keys, first_job: int) -> list[bool]:
    """Load chunk i of `keys` into its own slot (after the staging slot 0); returns each
    job's ok, and asserts that every loaded chunk holds exactly its payload."""
    results = run_jobs(tier, [TierJob(first_job + i, JobKind.LOAD, k, (i + 1) * NBYTES, NBYTES)
                              for i, k in enumerate(keys)])
    oks = [results[first_job + i].ok for i in range(len(keys))]
    for i, ok in enumerate(oks):
        if ok:
            np.testing.assert_array_equal(array[(i + 1) * NBYTES:(i + 2) * NBYTES],
                                          payload(i, NBYTES))
    return oks


def _lose_and_forget(harness, tier, array, keys, kind: str):
    """Store `keys`, damage chunks FIRST_LOST and later with `kind`, fail a load of chunk
    FIRST_LOST and tell the tier to forget it and the later ones; returns that load's result."""
    assert _store_prefix(tier, array, keys, 0) == [True] * PREFIX_CHUNKS
    for i, key in enumerate(keys[FIRST_LOST:]):
        harness.damage(tier, {}, key, kind, seed=i)
    failed = load(tier, keys[FIRST_LOST], NBYTES, NBYTES, job_id=100)
    tier.forget(keys[FIRST_LOST:])
    return failed


def _store_again(tier, array, keys) -> tuple[list[bool], int]:
    """Store `keys` again: (ok of each chunk from FIRST_LOST on, bytes the tier stored)."""
    before = tier.stats().get("bytes_stored", 0)
    restored = _store_prefix(tier, array, keys, 200)[FIRST_LOST:]
    return restored, tier.stats().get("bytes_stored", 0) - before


def test_a_forgotten_lost_prefix_misses_and_is_stored_anew(harness, open_tier, namespace,
                                                           host):
    if "delete" not in harness.damage_kinds:
        pytest.skip(f"{harness.name} cannot lose a stored chunk on demand: {harness.why_not}")
    array = np.frombuffer(host, dtype=np.uint8)
    tier = open_tier(host)
    keys = [chunk_key(namespace, i) for i in range(PREFIX_CHUNKS)]
    lost = PREFIX_CHUNKS - FIRST_LOST
    failed = _lose_and_forget(harness, tier, array, keys, "delete")
    answers = _lookups_once_settled(tier, keys, [Lookup.HIT] * FIRST_LOST + [Lookup.MISS] * lost)
    restored, stored = _store_again(tier, array, keys)

    assert not failed.ok
    assert answers == [Lookup.HIT] * FIRST_LOST + [Lookup.MISS] * lost
    assert restored == [True] * lost
    assert stored == lost * NBYTES
    assert [lookup(tier, k) for k in keys] == [Lookup.HIT] * PREFIX_CHUNKS
    assert _load_prefix(tier, array, keys, 300) == [True] * PREFIX_CHUNKS


def test_a_forgotten_record_the_store_still_holds_is_replaced(harness, open_tier, namespace,
                                                               host):
    """Chunks k and later are still stored but corrupt (a store that keeps listing what it
    can no longer serve): after `forget` their next store replaces them, never counts them as
    already stored."""
    if "bitflip-payload" not in harness.damage_kinds:
        pytest.skip(f"{harness.name} cannot corrupt a stored chunk in place: {harness.why_not}")
    array = np.frombuffer(host, dtype=np.uint8)
    tier = open_tier(host)
    if type(tier).forget is SecondaryTier.forget:
        pytest.skip(f"{harness.name}'s lookups read its chunks, not an index: nothing to "
                    "forget (SecondaryTier.forget's default)")
    keys = [chunk_key(namespace, i) for i in range(PREFIX_CHUNKS)]
    lost = PREFIX_CHUNKS - FIRST_LOST
    failed = _lose_and_forget(harness, tier, array, keys, "bitflip-payload")
    restored, stored = _store_again(tier, array, keys)

    assert not failed.ok
    assert restored == [True] * lost
    assert stored == lost * NBYTES
    assert _load_prefix(tier, array, keys, 300) == [True] * PREFIX_CHUNKS
