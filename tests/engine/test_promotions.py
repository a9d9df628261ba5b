"""Promotions from a secondary tier are bounded: a long waiting queue cannot flush the host tier."""
from __future__ import annotations

import os

import numpy as np

from kvhal.tier import Lookup
from kvhal.tiers.fs.format import chunk_path

from .rig import chunk_blocks, make_rig, synthetic_keys

HIT, MISS, RETRY = Lookup.HIT, Lookup.MISS, Lookup.RETRY


def test_a_queue_of_100_requests_with_disk_hits_keeps_the_hot_chunks(tmp_path):
    """100 waiting requests, 2 chunks each on disk only, all looked up in one scheduler step
    (and released: none was scheduled): promotions never hold more than `max_promotions`
    host slots, the rest answer RETRY without I/O, and the 8 hot chunks stay resident."""
    rig = make_rig(capacity=24, blocks_per_chunk=1, block_bytes=1024, num_blocks=256,
                   tiers=[{"type": "fs", "root_dir": str(tmp_path)}])
    m = rig.manager
    try:
        queued = [synthetic_keys(2, tag=r + 1) for r in range(100)]
        for keys in queued:                        # written once, now only on disk
            rig.store(keys, chunk_blocks(0, 2, 1))
            m.drain()
        m.clear()
        hot = synthetic_keys(8, tag=0)
        rig.dev[100:108] = np.arange(8)[:, None]
        rig.store(hot, chunk_blocks(100, 8, 1))
        m.drain()
        assert m.max_promotions == 8
        answers, held = [], []
        for r, keys in enumerate(queued):
            answers.append(m.lookup(keys, pin_owner=r))
            held.append(m.stats()["promotion_slots"])
        for r in range(100):
            m.release(r)
        assert [a for a in answers if a != [RETRY, RETRY]] == []
        assert max(held) == 8
        started = 200 - m.promotions_deferred
        assert 8 <= started <= 16                    # more only as earlier ones landed
        m.drain()
        assert m.lookup(hot) == [HIT] * 8
        assert m.stats()["resident"] == 8 + started and m.stats()["promotion_slots"] == 0
    finally:
        rig.close()


def test_a_landed_promotion_is_pinned_for_its_request_until_it_loads(tmp_path):
    """A chunk promoted for request r is not evictable between landing and r's load, even
    if other stores need the slot; once loaded it is an ordinary idle chunk."""
    rig = make_rig(capacity=2, blocks_per_chunk=1, block_bytes=1024, num_blocks=64,
                   tiers=[{"type": "fs", "root_dir": str(tmp_path)}])
    m = rig.manager
    try:
        (key,) = synthetic_keys(1, tag=1)
        rig.dev[0] = 5
        rig.store([key], chunk_blocks(0, 1, 1))
        m.drain()
        m.clear()
        assert m.lookup([key], pin_owner="r") == [RETRY]
        m.drain()                                   # lands: pinned for "r"
        others = synthetic_keys(2, tag=2)
        plan = m.prepare_store(others)              # room for one, the pinned chunk stays
        assert plan is not None and len(plan.keys) == 1
        m.complete_store(plan.job_id, 0)
        assert rig.load([key], chunk_blocks(10, 1, 1), pin_owner="r").num_ok == 1
        assert rig.dev[10, 0] == 5 and m.stats()["lookup_pins"] == 0
        assert m.stats()["promotion_slots"] == 0
    finally:
        rig.close()


def test_a_promotion_landing_after_its_request_left_is_evicted_first(tmp_path):
    """A chunk promoted for a request released before it landed is nobody's hot chunk: it
    lands at the cold end of the LRU, so the next eviction takes it, not the host tier's
    oldest chunk."""
    rig = make_rig(capacity=3, blocks_per_chunk=1, block_bytes=1024, num_blocks=64,
                   tiers=[{"type": "fs", "root_dir": str(tmp_path)}])
    m = rig.manager
    try:
        (promoted,) = synthetic_keys(1, tag=1)
        rig.store([promoted], chunk_blocks(0, 1, 1))
        m.drain()
        m.clear()
        hot = synthetic_keys(2, tag=2)
        rig.store(hot, chunk_blocks(1, 2, 1))
        m.drain()
        assert m.lookup([promoted], pin_owner="r") == [RETRY]
        m.release("r")                              # not scheduled: nobody waits for it
        m.drain()
        assert promoted in m.slots.index and m.stats()["promotion_slots"] == 0   # landed
        plan = m.prepare_store(synthetic_keys(1, tag=3))
        assert plan is not None
        m.complete_store(plan.job_id, 1)
        assert m.lookup(hot) == [HIT, HIT]
        assert promoted not in m.slots.index
    finally:
        rig.close()


def _fs_rig(tmp_path):
    """A 16-slot host tier of 1-block chunks over an fs tier that never refreshes its index on
    its own (an hour apart): only `forget` and stores move it."""
    return make_rig(capacity=16, blocks_per_chunk=1, block_bytes=1024, num_blocks=64,
                    tiers=[{"type": "fs", "root_dir": str(tmp_path), "refresh_interval_s": 3600}])


def test_a_failed_promotion_makes_its_tier_forget_that_chunk_and_the_later_ones(tmp_path):
    """A prefix of 6 chunks lives only in an fs tier; the file of chunk 2 is deleted. A lookup
    promotes all 6; chunk 2's promotion fails: the fs index drops chunks 2-5 (the later ones
    may be gone too: each would be a promise that fails late), keeps 0 and 1, and the next
    store of the prefix writes 2-5 again (4 chunks' bytes), after which every chunk loads
    exact. No refresh runs meanwhile (an hour apart), so only the forget moves the index.
    Seen failing with the tier told to forget only the failing chunk: 3-5 stayed HIT."""
    rig = _fs_rig(tmp_path)
    m, fs = rig.manager, rig.manager.tiers[0]
    try:
        keys = synthetic_keys(6, tag=7)
        rig.dev[:6] = np.arange(1, 7)[:, None]
        rig.store(keys, chunk_blocks(0, 6, 1))
        m.drain()
        m.clear()
        os.unlink(chunk_path(fs.ns_dir, keys[2]))
        stored_before = fs.stats()["bytes_stored"]

        assert m.lookup(keys, pin_owner="r") == [RETRY] * 6
        m.drain()
        retried = m.lookup(keys, pin_owner="r")      # the request learns of the failure
        m.release("r")
        after_failure = [fs.lookup(k) for k in keys]
        m.clear()
        rig.store(keys, chunk_blocks(0, 6, 1))
        m.drain()
        m.clear()
        rewritten = fs.stats()["bytes_stored"] - stored_before
        answers = m.lookup(keys, pin_owner="s")
        m.drain()
        loaded = rig.load(keys, chunk_blocks(10, 6, 1), pin_owner="s")
        values = rig.dev[10:16, 0].tolist()
    finally:
        rig.close()

    assert retried == [HIT, HIT, MISS, MISS, MISS, MISS]
    assert after_failure == [HIT, HIT, MISS, MISS, MISS, MISS]
    assert rewritten == 4 * 1024
    assert answers == [RETRY] * 6
    assert loaded.num_ok == 6
    assert values == [1, 2, 3, 4, 5, 6]


def test_a_failed_promotion_leaves_the_chunks_before_it_alone(tmp_path):
    """The lookup of a prefix whose first chunks are in host memory and whose later ones are
    in the fs tier: the first tier chunk (chunk 2) fails to load; the tier forgets chunks 2-3,
    and keeps chunks 0 and 1 (earlier in the prefix, never in doubt). Seen failing with the
    tier told to forget every key of the prefix: chunks 0 and 1 became MISS."""
    rig = _fs_rig(tmp_path)
    m, fs = rig.manager, rig.manager.tiers[0]
    try:
        keys = synthetic_keys(4, tag=8)
        rig.store(keys, chunk_blocks(0, 4, 1))
        m.drain()
        m.discard(keys[2:])
        os.unlink(chunk_path(fs.ns_dir, keys[2]))

        assert m.lookup(keys, pin_owner="r") == [HIT, HIT, RETRY, RETRY]
        m.drain()
        m.release("r")
        after_failure = [fs.lookup(k) for k in keys]
    finally:
        rig.close()

    assert after_failure == [HIT, HIT, MISS, MISS]


def test_a_late_failed_promotion_leaves_chunks_stored_anew_since(tmp_path):
    """Chunk 2 of a 4-chunk prefix lives only in the fs tier, and its file is gone; one
    promotion at a time, so the lookup promotes chunk 2 and defers 3. Before chunk 2's
    failure is collected, the request computes chunks 2-3 again (a recompute) and stores
    chunk 3 — the tier already lists it. The failure then makes the tier forget chunk 2 only:
    chunk 3 was stored after the failed load began, so it stays a HIT. Seen failing with
    every later chunk forgotten regardless: chunk 3 became MISS."""
    rig = _fs_rig(tmp_path)
    m, fs = rig.manager, rig.manager.tiers[0]
    try:
        keys = synthetic_keys(4, tag=9)
        rig.store(keys, chunk_blocks(0, 4, 1))
        m.drain()
        m.discard(keys[2:])
        os.unlink(chunk_path(fs.ns_dir, keys[2]))
        m.max_promotions = 1

        assert m.lookup(keys, pin_owner="r") == [HIT, HIT, RETRY, RETRY]
        fs.drain()                           # chunk 2's load has failed, not collected yet
        assert rig.store(keys[3:], chunk_blocks(3, 1, 1)).num_ok == 1
        m.drain()
        m.release("r")
        after_failure = [fs.lookup(k) for k in keys]
    finally:
        rig.close()

    assert after_failure == [HIT, HIT, MISS, HIT]
