"""The shared LRU index of storage tiers: byte accounting, reconcile, and removal tracking."""
from __future__ import annotations

import math
import time

import pytest

from kvhal.keys import ChunkKey
from kvhal.tiers.index import ChunkIndex, StoresInFlight

from .helpers import NAMESPACE


def _key(i: int) -> ChunkKey:
    return ChunkKey(NAMESPACE, 0, i.to_bytes(32, "big"))


def test_reserve_evicts_least_recently_used_and_reports_them_removed():
    index = ChunkIndex()
    for i in range(4):
        index.add(_key(i), 100)
    index.touch(_key(0))

    victims = index.reserve(150, max_bytes=400)

    assert victims == [(_key(1), 100), (_key(2), 100)]
    assert index.used_bytes == 350
    assert index.take_removed() == [_key(1), _key(2)]
    assert index.take_removed() == []


def test_reserve_refuses_what_stores_in_flight_leave_no_room_for_and_evicts_nothing():
    index = ChunkIndex()
    index.add(_key(0), 100)
    assert index.reserve(350, max_bytes=400) == [(_key(0), 100)]
    index.add(_key(1), 100)

    with pytest.raises(StoresInFlight, match="200 bytes do not fit in max_bytes 400 while "
                                             "stores in flight hold 350 bytes"):
        index.reserve(200, max_bytes=400)

    assert (_key(1) in index, index.used_bytes, index.take_removed()) == (True, 450, [_key(0)])
    index.release(350)
    assert index.reserve(200, max_bytes=400) == []
    assert index.used_bytes == 300


def test_a_finished_store_is_indexed_in_the_step_that_ends_its_reservation():
    index = ChunkIndex()
    assert index.reserve(100, max_bytes=400) == []
    index.release(100, _key(1))                  # its bytes never stop counting
    assert (index.used_bytes, _key(1) in index) == (100, True)
    assert index.reserve(100, max_bytes=400) == []
    index.add(_key(2), 100)                      # a listing indexed the new file first
    index.release(100, _key(2))
    assert index.used_bytes == 200
    assert index.reserve(100, max_bytes=400) == []
    index.release(100)                           # a failed store: nothing indexed
    assert (index.used_bytes, len(index)) == (200, 2)


def test_discard_reports_only_keys_that_were_indexed():
    index = ChunkIndex()
    index.add(_key(1), 10)

    index.discard(_key(1))
    index.discard(_key(2))

    assert index.take_removed() == [_key(1)]


def test_reconcile_drops_what_a_listing_missed_and_keeps_later_adds():
    index = ChunkIndex()
    index.add(_key(1), 10)
    index.add(_key(2), 10)
    index.reconcile({_key(1): 10, _key(2): 10}, index.snapshot()[1])  # a first listing
    _, epoch = index.snapshot()
    index.add(_key(3), 10)  # stored while the listing ran

    index.reconcile({_key(2): 10, _key(4): 20}, epoch)

    assert [k in index for k in map(_key, range(1, 5))] == [False, True, True, True]
    assert index.used_bytes == 40
    assert index.take_removed() == [_key(1)]


def test_a_victim_of_reserve_is_not_brought_back_by_a_listing_begun_before():
    # the listing saw the victim's file before the store that evicted it deleted it: the
    # merge must not count those bytes again (used_bytes stays within max_bytes)
    index = ChunkIndex()
    for i in range(4):
        index.add(_key(i), 100)
    _, epoch = index.snapshot()

    victims = index.reserve(100, max_bytes=400)
    index.reconcile({_key(i): 100 for i in range(4)}, epoch)

    assert victims == [(_key(0), 100)]
    assert _key(0) not in index
    assert index.used_bytes == 400


def test_a_held_key_stays_out_of_listings_until_its_deadline_or_unhold():
    index = ChunkIndex()
    index.add(_key(1), 10)
    index.add(_key(2), 10)

    index.hold([_key(1)], until=math.inf)
    index.hold([_key(2)], until=time.monotonic() - 1)  # already expired
    index.reconcile({_key(1): 10, _key(2): 10}, index.snapshot()[1])
    held_after_listing = (_key(1) in index, _key(2) in index)
    index.unhold([_key(1)])
    index.reconcile({_key(1): 10}, index.snapshot()[1])

    assert held_after_listing == (False, True)
    assert _key(1) in index


def test_a_listing_that_adds_or_drops_keys_calls_on_change_and_one_that_does_not_stays_quiet():
    """`SecondaryTier.watch`'s source: fails when a listing's news reach `take_found` /
    `take_removed` without a call (an idle engine would not wake to publish them), or when a
    listing that changed nothing calls it (an idle engine would step for nothing)."""
    index = ChunkIndex()
    calls = []
    index.on_change = lambda: calls.append((index.take_found(), index.take_removed()))
    index.reconcile({_key(1): 100, _key(2): 100}, index.snapshot()[1])   # found at start
    index.reconcile({_key(1): 100, _key(2): 100}, index.snapshot()[1])   # nothing new
    index.reconcile({_key(1): 100}, index.snapshot()[1])                 # 2 deleted elsewhere
    index.reconcile({_key(1): 100, _key(3): 100}, index.snapshot()[1])   # 3 written elsewhere

    assert calls == [([_key(1), _key(2)], []), ([], [_key(2)]), ([_key(3)], [])]
