"""Manager bookkeeping: eviction rules, pins, promotion, cascade, prefixes, namespaces."""
from __future__ import annotations

import logging
import random

import numpy as np
import pytest

from kvhal.config import CostModelConfig
from kvhal.engine import EngineError, PrefixHit, chunks_to_store, leading_hits, prefix_hit
from kvhal.engine.cost import CostModel
from kvhal.events import BlockRemoved, BlockStored
from kvhal.tier import Lookup
from kvhal.tiers.memory import MemoryTier

from .rig import chunk_blocks, make_rig, namespace, prompt_keys, synthetic_keys

HIT, MISS, RETRY = Lookup.HIT, Lookup.MISS, Lookup.RETRY


@pytest.fixture
def rig():
    r = make_rig(capacity=4, blocks_per_chunk=1, block_bytes=256, num_blocks=64)
    yield r
    r.close()


def _fill(rig, keys):
    """Store keys into the host tier (their device blocks hold the key index)."""
    for i in range(len(keys)):
        rig.dev[i] = i
    return rig.store(keys, chunk_blocks(0, len(keys), 1))


def test_prepare_store_never_evicts_the_batch_being_stored(rig):
    a, b, c, d, e, f = synthetic_keys(6)
    _fill(rig, [a, b, c, d])                      # LRU order: a b c d (a is the first victim)
    rig.manager.take_events()
    plan = rig.manager.prepare_store([a, e, f])
    assert plan.keys == (e, f) and plan.indices.tolist() == [1, 2]
    assert rig.manager.take_events() == [BlockRemoved((b.block_hash, c.block_hash), 0, "CPU")]
    assert rig.manager.lookup([a, b, c, d]) == [HIT, MISS, MISS, MISS]
    rig.manager.complete_store(plan.job_id, 0)


def test_prepare_store_skips_slots_with_readers_or_writers(rig):
    a, b, c, d, e, f, g, h, i = synthetic_keys(9)
    _fill(rig, [a, b, c, d])
    reader = rig.manager.prepare_load([a])                        # a: one reader
    writer = rig.manager.prepare_store([e])                       # evicts b; e: writing
    assert rig.manager.prepare_store([f, g]).keys == (f, g)       # evicts c, d
    deferred = rig.manager.prepare_store([h, i])                  # nothing idle is left
    assert deferred is None
    assert rig.manager.stats()["reading_slots"] == 1 and rig.manager.stats()["writing_slots"] == 3
    rig.manager.complete_load(reader.job_id)
    assert rig.manager.prepare_store([h, i]).keys == (h,)         # a evicted; e, f, g writing
    rig.manager.complete_store(writer.job_id)



def test_num_held_counts_the_leading_chunks_resident_or_being_stored(rig):
    """After a store that did not fit, `num_held` points at the first chunk left out: a, b
    resident, c, d placed, e found no slot (4 slots, all busy)."""
    a, b, c, d, e = synthetic_keys(5)
    _fill(rig, [a, b])
    reader = rig.manager.prepare_load([a, b])               # a, b: readers, not evictable
    plan = rig.manager.prepare_store([a, b, c, d, e])
    assert plan.keys == (c, d)
    assert rig.manager.num_held([a, b, c, d, e]) == 4
    assert rig.manager.num_held([e, a]) == 0
    rig.manager.complete_store(plan.job_id)
    rig.manager.complete_load(reader.job_id)


def test_skip_store_counts_every_call_and_warns_once_an_interval(rig, caplog):
    rig.manager.metrics.take_delta()
    with caplog.at_level(logging.WARNING, logger="kvhal.engine.manager"):
        rig.manager.skip_store(3)
        rig.manager.skip_store(2)
        rig.manager.skip_store(0)
    assert rig.manager.metrics.take_delta()["counters"]["skipped_chunks"] == {"host": 5}
    assert [r.getMessage() for r in caplog.records] == [
        "kvhal: 3 chunks due for storing found no free host slot before their request ended "
        "and were not stored: the host tier (4 slots, cpu_bytes_to_use) is smaller than one "
        "step's stores"]


def test_a_key_repeated_in_one_store_batch_takes_one_slot(rig):
    a, b = synthetic_keys(2)
    plan = rig.manager.prepare_store([a, a, b])
    assert plan.keys == (a, b) and plan.indices.tolist() == [0, 2]
    rig.manager.complete_store(plan.job_id, 1)                    # b failed

    assert rig.manager.stats()["resident"] == 1 and rig.manager.slots.num_free == 3
    assert rig.manager.lookup([a, b]) == [HIT, MISS]
    churn = synthetic_keys(8, tag=1)
    for key in churn:                                             # evicts a, never raises
        rig.manager.complete_store(rig.manager.prepare_store([key]).job_id)
    assert rig.manager.stats()["resident"] == 4 and rig.manager.slots.num_free == 0


def test_eviction_defers_while_a_reader_holds_the_slot_and_the_reader_gets_its_bytes():
    rig = make_rig(capacity=2, blocks_per_chunk=2, block_bytes=4096, num_blocks=16,
                   chaos_seed=11)
    try:
        keys = synthetic_keys(4)
        rig.dev[0:4] = np.arange(4 * 4096, dtype=np.uint32).view(np.uint8)[:4 * 4096].reshape(
            4, 4096)
        want = rig.dev[0:2].copy()
        rig.store(keys[:2], chunk_blocks(0, 2, 2))
        plan = rig.manager.prepare_load(keys[:1])
        rig.worker.submit_load(plan.job_id, chunk_blocks(8, 1, 2), plan.slots)
        rig.manager.clear()                                   # chunk 0 has a reader: deferred
        assert rig.manager.lookup(keys[:2]) == [MISS, MISS]
        store = rig.manager.prepare_store(keys[2:])           # one slot is still in use
        assert store.keys == (keys[2],) and store.slots.tolist() != plan.slots.tolist()
        rig.manager.complete_store(store.job_id, 0)
        assert rig.finish(plan.job_id).num_ok == 1
        assert np.array_equal(rig.dev[8:10], want)
        assert rig.manager.stats()["free_slots"] == 2
    finally:
        rig.close()


def test_every_lookup_pin_is_released_after_10000_mixed_operations():
    rig = make_rig(capacity=16, blocks_per_chunk=1, block_bytes=64, num_blocks=16)
    m, rng = rig.manager, random.Random(1234)
    keys = synthetic_keys(48)
    open_stores, open_loads, requests = [], [], set()
    for step in range(10_000):
        op = rng.randrange(6)
        start = rng.randrange(40)
        prefix = keys[start:start + rng.randrange(1, 9)]
        rid = rng.randrange(12)
        if op == 0:
            m.lookup(prefix, pin_owner=rid)
            requests.add(rid)
        elif op == 1:                                   # load after lookup: pins become reads
            plan = m.prepare_load(prefix, pin_owner=rid)
            if plan:
                open_loads.append(plan.job_id)
        elif op == 2:                                   # request aborted / finished
            m.release(rid)
        elif op == 3:
            plan = m.prepare_store(prefix)
            if plan:
                open_stores.append((plan.job_id, len(plan.keys)))
        elif op == 4 and open_stores:                   # success, partial failure or failure
            job, n = open_stores.pop(rng.randrange(len(open_stores)))
            m.complete_store(job, rng.choice([n, rng.randrange(n + 1), 0]))
        elif op == 5 and open_loads:
            m.complete_load(open_loads.pop(rng.randrange(len(open_loads))), rng.choice([0, 1]))
    for rid in requests:
        m.release(rid)
    for job, n in open_stores:
        m.complete_store(job, n)
    for job in open_loads:
        m.complete_load(job)
    stats = m.stats()
    assert (stats["lookup_pins"], stats["reading_slots"], stats["writing_slots"]) == (0, 0, 0)
    assert rig.manager.slots.state == [0] * 16
    fresh = synthetic_keys(16, tag=7)
    assert len(m.prepare_store(fresh).keys) == 16       # eviction still makes progress
    rig.close()


def test_lookup_pins_protect_hits_until_released(rig):
    keys = synthetic_keys(6)
    _fill(rig, keys[:4])
    assert rig.manager.lookup(keys[:2], pin_owner="r") == [HIT, HIT]
    assert rig.manager.prepare_store(keys[4:6]).keys == (keys[4], keys[5])  # evicts 2, 3
    assert rig.manager.lookup(keys[:4]) == [HIT, HIT, MISS, MISS]
    rig.manager.release("r")
    assert rig.manager.stats()["lookup_pins"] == 0 and rig.manager.stats()["reading_slots"] == 0


def test_keys_after_the_first_miss_answer_miss(rig):
    keys = synthetic_keys(3)
    _fill(rig, [keys[0], keys[2]])
    assert rig.manager.lookup(keys, pin_owner="r") == [HIT, MISS, MISS]
    assert rig.manager.stats()["lookup_pins"] == 1
    rig.manager.release("r")


def test_completing_a_job_twice_is_refused(rig):
    plan = rig.manager.prepare_store(synthetic_keys(1))
    rig.manager.complete_store(plan.job_id)
    with pytest.raises(EngineError, match=f"store job {plan.job_id} is not open"):
        rig.manager.complete_store(plan.job_id)


def test_promotion_answers_retry_until_the_chunk_lands_then_hit():
    rig = make_rig(capacity=4, blocks_per_chunk=1, block_bytes=1024, num_blocks=16,
                   tiers=[{"type": "memory"}])
    try:
        keys = synthetic_keys(3)
        rig.dev[0:3] = np.arange(3)[:, None]
        rig.store(keys, chunk_blocks(0, 3, 1))
        rig.manager.drain()
        rig.manager.clear()
        assert rig.manager.lookup(keys, pin_owner="r") == [RETRY, RETRY, RETRY]
        assert rig.manager.stats()["writing_slots"] == 3
        assert rig.manager.lookup(keys, pin_owner="r") == [HIT, HIT, HIT]
        rig.dev[:] = 255
        assert rig.load(keys, chunk_blocks(8, 3, 1), pin_owner="r").num_ok == 3
        assert rig.dev[8:11, 0].tolist() == [0, 1, 2] and rig.manager.stats()["lookup_pins"] == 0
    finally:
        rig.close()


class FaultyLoadTier(MemoryTier):
    """A memory tier whose loads fail (a corrupt or vanished chunk)."""

    name = "faulty"

    def submit_load(self, job):
        self._finish(job, 0.0, "injected load failure")


@pytest.fixture
def only_in_a_faulty_tier():
    """(rig, key): `key` stored, then dropped from host memory; its one tier's loads fail."""
    rig = make_rig(capacity=4, blocks_per_chunk=1, block_bytes=1024, num_blocks=16)
    tier = FaultyLoadTier({}, rig.region.view, namespace())
    rig.manager.tiers, rig.manager.tier_labels = (tier,), ["faulty"]
    rig.manager.cost = CostModel(CostModelConfig(), ["faulty"], None)
    try:
        (key,) = synthetic_keys(1)
        rig.store([key], chunk_blocks(0, 1, 1))
        rig.manager.poll()
        rig.manager.clear()
        yield rig, key
    finally:
        rig.close()


def test_failed_promotion_answers_miss_once_then_tries_again(only_in_a_faulty_tier):
    rig, key = only_in_a_faulty_tier
    assert [rig.manager.lookup([key]) for _ in range(3)] == [[RETRY], [MISS], [RETRY]]


def test_a_failed_promotion_is_logged_with_its_tier_chunk_and_reason(only_in_a_faulty_tier,
                                                                     caplog):
    """An operator sees why a tier hit turned into a recompute. Fails with the log line
    removed from `Manager.poll`."""
    rig, key = only_in_a_faulty_tier
    with caplog.at_level(logging.WARNING, "kvhal.engine.manager"):
        assert rig.manager.lookup([key]) == [RETRY]
        rig.manager.poll()
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith(
        f"faulty tier: load of chunk {key.block_hash.hex()[:16]} failed after ")
    assert record.getMessage().endswith(": injected load failure")


def test_every_stored_chunk_cascades_to_every_secondary_tier():
    rig = make_rig(capacity=8, blocks_per_chunk=1, block_bytes=1024, num_blocks=16,
                   tiers=[{"type": "memory"}, {"type": "memory", "max_bytes": 1 << 20}])
    try:
        keys = synthetic_keys(5)
        result = rig.store(keys, chunk_blocks(0, 5, 1))
        assert rig.manager.stats()["reading_slots"] == 5          # held by the cascades
        rig.manager.poll()
        assert [t.stats()["chunks"] for t in rig.manager.tiers] == [5, 5]
        assert rig.manager.stats()["reading_slots"] == 0 and result.num_ok == 5
        assert [(e.tier, e.medium, e.locality) for e in rig.manager.take_events()] == [
            ("host", "CPU", "LOCAL"), ("memory", "CPU", "LOCAL"), ("memory-2", "CPU", "LOCAL")]
    finally:
        rig.close()


def _prefill(rig, keys, schedule, tokens_per_chunk, max_offload_tokens=None):
    """Run a (chunked) prefill: store what `chunks_to_store` says after each step."""
    stored = 0
    for computed in schedule:
        due = chunks_to_store(computed, stored, tokens_per_chunk, max_offload_tokens)
        if due:
            blocks = chunk_blocks(0, len(due), rig.blocks_per_chunk)
            rig.store([keys[i] for i in due], blocks)
            stored = due.stop


@pytest.fixture
def big_rig():
    r = make_rig(capacity=200, blocks_per_chunk=16, block_bytes=64, num_blocks=16 * 160)
    yield r
    r.close()


def test_chunked_prefill_stores_a_contiguous_prefix(big_rig):
    tokens = list(range(40_000))
    keys = prompt_keys(tokens, 16, namespace())
    _prefill(big_rig, keys, [min(40_000, s * 8192) for s in range(1, 6)], 256)
    hits = leading_hits(big_rig.manager.lookup(keys))
    assert hits * 256 == 39_936


@pytest.mark.parametrize("num_tokens,hit_tokens", [(0, 0), (1, 0), (15, 0), (255, 0), (256, 256),
                                                   (257, 256), (900, 768)])
def test_only_full_chunks_are_stored(big_rig, num_tokens, hit_tokens):
    tokens = [t % 50_000 for t in range(7, 7 + num_tokens)]
    keys = prompt_keys(tokens, 16, namespace())
    _prefill(big_rig, keys, [num_tokens], 256)
    assert leading_hits(big_rig.manager.lookup(keys)) * 256 == hit_tokens


def test_zero_token_request_is_a_no_op(big_rig):
    assert big_rig.manager.lookup([], pin_owner="r") == []
    assert big_rig.manager.prepare_store([]) is None
    assert big_rig.manager.prepare_load([], pin_owner="r") is None
    assert chunks_to_store(0, 0, 256) == range(0, 0)
    assert big_rig.manager.stats()["resident"] == 0


@pytest.mark.parametrize("cap,hit_tokens", [(0, 0), (255, 0), (300, 256), (768, 768),
                                            (10_000, 768), (None, 768)])
def test_max_offload_tokens_caps_what_is_stored(big_rig, cap, hit_tokens):
    keys = prompt_keys(list(range(900)), 16, namespace())
    _prefill(big_rig, keys, [512, 900], 256, max_offload_tokens=cap)
    assert leading_hits(big_rig.manager.lookup(keys)) * 256 == hit_tokens


@pytest.mark.parametrize("field,value", [("kv_dtype", "fp8_e4m3"), ("weights", "xxh3-128:other"),
                                         ("tenant_salt", "tenant-b")])
def test_no_hits_across_namespaces(big_rig, field, value):
    tokens = list(range(1024))
    _prefill(big_rig, prompt_keys(tokens, 16, namespace()), [1024], 256)
    assert leading_hits(big_rig.manager.lookup(prompt_keys(tokens, 16, namespace()))) == 4
    other = prompt_keys(tokens, 16, namespace(**{field: value}))
    assert big_rig.manager.lookup(other) == [MISS] * 4


def test_leading_hits_waits_on_retry_before_the_first_miss():
    assert leading_hits([HIT, HIT, MISS, RETRY]) == 2
    assert leading_hits([HIT, RETRY, HIT]) is None
    assert leading_hits([]) == 0


def test_prefix_hit_counts_chunks_before_the_first_miss_and_what_they_wait_for():
    UNDECIDED = Lookup.UNDECIDED
    assert prefix_hit([HIT, RETRY, UNDECIDED, MISS, HIT]) == PrefixHit(3, 1, True, True)
    assert prefix_hit([HIT, HIT, MISS, RETRY]) == PrefixHit(2, 2, False, False)
    assert prefix_hit([]) == PrefixHit(0, 0, False, False)


def test_kv_events_reach_hook_implementations(monkeypatch):
    seen = []
    monkeypatch.setattr("kvhal.plugins.emit_kv_event", seen.append)
    rig = make_rig(capacity=1, blocks_per_chunk=1, block_bytes=64, num_blocks=4)
    rig.manager._emit = True
    try:
        a, b = synthetic_keys(2)
        rig.store([a], chunk_blocks(0, 1, 1))
        rig.store([b], chunk_blocks(1, 1, 1))
        assert seen == [BlockStored((a.block_hash,), 0, "CPU"),
                        BlockRemoved((a.block_hash,), 0, "CPU"),
                        BlockStored((b.block_hash,), 0, "CPU")]
    finally:
        rig.close()


def test_chunks_survive_a_restart_through_the_fs_tier(tmp_path):
    """Store with an fs tier, drop the whole engine, build a new one on the same folder: the
    chunks come back by promotion (RETRY while the tier's threads read, then HIT)."""
    tiers = [{"type": "fs", "root_dir": str(tmp_path)}]
    keys = synthetic_keys(3)
    first = make_rig(capacity=4, blocks_per_chunk=2, block_bytes=2048, num_blocks=16,
                     tiers=tiers)
    try:
        want = np.random.default_rng(3).integers(0, 256, (6, 2048), dtype=np.uint8)
        first.dev[0:6] = want
        first.store(keys, chunk_blocks(0, 3, 2))
        first.manager.drain()
        assert first.manager.stats()["reading_slots"] == 0
    finally:
        first.close()
    second = make_rig(capacity=4, blocks_per_chunk=2, block_bytes=2048, num_blocks=16,
                      tiers=tiers)
    try:
        assert second.manager.lookup(keys, pin_owner="r") == [RETRY, RETRY, RETRY]
        second.manager.drain()
        assert second.manager.lookup(keys, pin_owner="r") == [HIT, HIT, HIT]
        assert second.load(keys, chunk_blocks(8, 3, 2), pin_owner="r").num_ok == 3
        assert np.array_equal(second.dev[8:14], want)
    finally:
        second.close()


def test_a_restarted_engine_announces_what_its_fs_tier_holds_with_descriptions(tmp_path):
    """Chunks stored with descriptions (`Manager.describe`) are announced by the next engine on
    the same folder as soon as it is built (before any request), with those descriptions; the
    engine then has pending work until the events are taken (the integration steps vLLM for
    them). Fails when the found chunks are not announced (the issue's restart: 0 events)."""
    tiers = [{"type": "fs", "root_dir": str(tmp_path)}]
    keys = synthetic_keys(3)
    first = make_rig(capacity=4, blocks_per_chunk=1, block_bytes=2048, num_blocks=16,
                     tiers=tiers)
    try:
        first.manager.describe = lambda key: b"about " + key.block_hash[:4]
        first.store(keys, chunk_blocks(0, 3, 1))
        assert first.manager.has_pending_work()         # events untaken, stores in flight
        first.manager.drain()
        first.manager.take_events()
        assert not first.manager.has_pending_work()
    finally:
        first.close()
    second = make_rig(capacity=4, blocks_per_chunk=1, block_bytes=2048, num_blocks=16,
                      tiers=tiers)
    try:
        assert second.manager.has_pending_work()
        (event,) = second.manager.take_events()
        assert not second.manager.has_pending_work()
    finally:
        second.close()
    assert (event.medium, event.locality, event.tier) == ("STORAGE", "LOCAL", "fs")
    assert dict(zip(event.block_hashes, event.descriptions)) == {
        k.block_hash: b"about " + k.block_hash[:4] for k in keys}


def test_a_chunk_leaving_a_secondary_tier_is_announced_with_its_medium():
    rig = make_rig(capacity=4, blocks_per_chunk=1, block_bytes=64, num_blocks=16,
                   tiers=[{"type": "memory", "max_bytes": 2 * 64}])
    try:
        a, b, c = synthetic_keys(3)
        rig.store([a, b, c], chunk_blocks(0, 3, 1))
        rig.manager.poll()                              # the tier keeps b, c; a left it
        events = rig.manager.take_events()
    finally:
        rig.close()
    hashes = (a.block_hash, b.block_hash, c.block_hash)
    assert events == [BlockStored(hashes, 0, "CPU"),
                      BlockStored(hashes, 0, "CPU", "LOCAL", "memory"),
                      BlockRemoved((a.block_hash,), 0, "CPU", "LOCAL", "memory")]
