"""p2p attached to real engine managers: instance B's lookups promote chunks instance A's host
tier holds, straight from A's slots; A's pins hold slots against eviction and rewrite; A's
losses reach B's directory."""
from __future__ import annotations

import numpy as np
import pytest

from kvhal.engine.manager import Manager
from kvhal.host.policy import LRUPolicy
from kvhal.host.slots import SlotTable
from kvhal.tier import Lookup
from kvhal.tiers.p2p import P2PTier

from .helpers import NAMESPACE, chunk_key, host_region, payload, wait_for
from .p2p_helpers import config

SLOT = 64 << 10
CAPACITY = 8


def _instance(cfg):
    host, array = host_region(SLOT * CAPACITY)
    tier = P2PTier(cfg, host, NAMESPACE)
    manager = Manager(SlotTable(CAPACITY, LRUPolicy(CAPACITY)), slot_bytes=SLOT,
                      chunk_nbytes=SLOT, tiers=[tier], emit_events=False)
    return manager, tier, array


def _store(manager, array, first: int, count: int):
    keys = [chunk_key(NAMESPACE, i) for i in range(first, first + count)]
    plan = manager.prepare_store(keys)
    for i, slot in zip(range(first, first + count), plan.slots):
        array[slot * SLOT:(slot + 1) * SLOT] = payload(i, SLOT)
    manager.complete_store(plan.job_id)
    manager.drain(10)
    return keys


@pytest.fixture
def pair():
    a, a_tier, a_array = _instance(config())
    b, b_tier, b_array = _instance(config(peers=[a_tier.identity]))
    assert b_tier.wait_synced(20)
    yield (a, a_tier, a_array), (b, b_tier, b_array)
    b.close()
    a.close()


def test_lookup_promotes_a_peers_host_chunks_byte_exact(pair):
    (a, a_tier, a_array), (b, b_tier, b_array) = pair
    keys = _store(a, a_array, 0, 3)
    wait_for(lambda: all(b_tier.lookup(k) is Lookup.HIT for k in keys), what="a's gains")

    first = b.lookup(keys)
    wait_for(lambda: b.lookup(keys) == [Lookup.HIT] * 3, what="promotions")

    assert first == [Lookup.RETRY] * 3
    for i, key in enumerate(keys):
        slot = b.slots.index[key]
        np.testing.assert_array_equal(b_array[slot * SLOT:(slot + 1) * SLOT], payload(i, SLOT))
    assert a_tier.stats()["attached"]
    # counted and unpinned once the serving write returned, maybe after b has the bytes
    wait_for(lambda: (a_tier.stats().get("chunks_served"), a.stats()["reading_slots"]) == (3, 0),
             what="3 chunks served, every serve's slot unpinned")


def test_a_pinned_slot_is_neither_evicted_nor_rewritten(pair):
    (a, a_tier, a_array), _ = pair
    (key,) = _store(a, a_array, 0, 1)
    access = a_tier._source._access
    offset = access.pin(key)

    a.discard([key])
    for first in range(100, 100 + 3 * CAPACITY, CAPACITY):   # evicts every other slot twice
        _store(a, a_array, first, CAPACITY - 1)
    held = a_array[offset:offset + SLOT].copy()
    access.unpin(offset)
    plan = a.prepare_store([chunk_key(NAMESPACE, 200)])

    np.testing.assert_array_equal(held, payload(0, SLOT))
    assert int(plan.slots[0]) * SLOT == offset  # freed at the unpin, the only free slot
    a.complete_store(plan.job_id, 0)


def test_pin_refuses_a_slot_being_written(pair):
    (a, a_tier, _), _ = pair
    plan = a.prepare_store([chunk_key(NAMESPACE, 9)])
    assert a_tier._source._access.pin(chunk_key(NAMESPACE, 9)) is None
    a.complete_store(plan.job_id, 0)


def test_host_losses_leave_the_peers_directory(pair):
    (a, a_tier, a_array), (_, b_tier, _) = pair
    keys = _store(a, a_array, 0, 2)
    wait_for(lambda: b_tier.lookup(keys[1]) is Lookup.HIT, what="gain")

    a.discard([keys[1]])

    wait_for(lambda: b_tier.lookup(keys[1]) is Lookup.MISS, what="loss")
    assert b_tier.lookup(keys[0]) is Lookup.HIT
    assert keys[1] in a_tier.take_removed()


def test_a_host_slot_is_hashed_once_per_residence(pair):
    (a, a_tier, a_array), (b, b_tier, b_array) = pair
    (key,) = _store(a, a_array, 0, 1)

    def pull_into_b() -> np.ndarray:
        b.discard([key])
        wait_for(lambda: b_tier.lookup(key) is Lookup.HIT, what="a's chunk in b's directory")
        b.lookup([key])
        wait_for(lambda: b.lookup([key]) == [Lookup.HIT], what="promotion")
        slot = b.slots.index[key]
        return b_array[slot * SLOT:(slot + 1) * SLOT].copy()

    first, second = pull_into_b(), pull_into_b()
    digests_while_resident = a_tier.stats()["serve_digests"]
    _store(a, a_array, 100, CAPACITY - 1)  # A full: the chunk's slot is the one freed next
    old_slot = a.slots.index[key]
    a.discard([key])                       # A loses the chunk, then holds new bytes under it
    plan = a.prepare_store([key])
    slot = int(plan.slots[0])
    assert slot == old_slot                # same key, same slot, other bytes
    a_array[slot * SLOT:(slot + 1) * SLOT] = payload(7, SLOT)
    a.complete_store(plan.job_id)
    a.drain(10)
    third = pull_into_b()

    np.testing.assert_array_equal(first, payload(0, SLOT))
    np.testing.assert_array_equal(second, payload(0, SLOT))
    np.testing.assert_array_equal(third, payload(7, SLOT))
    assert (digests_while_resident, a_tier.stats()["serve_digests"]) == (1, 2)
    wait_for(lambda: a_tier.stats().get("chunks_served") == 3, what="3 chunks served")
