"""No promotion storm in the replay: a queue of 100 waiting requests with tier hits, asked
about every step and never scheduled, leaves the hits of the requests that run unchanged."""
from __future__ import annotations

import functools

from kvhal.engine.manager import Manager
from kvhal.host.slots import SlotTable
from kvhal.integrations.harness import read_trace, reference_hits
from kvhal.integrations.harness.geometry import PRESETS
from kvhal.integrations.harness.replay import ReplayOptions, run_replay

from .conftest import mooncake

CHUNK, CHUNK_BYTES = 512, 32 << 10          # tiny preset: 64 B/token
QUEUED = [1000 + i for i in range(100)]     # stored once, then only in the memory tier
HOT = list(range(1, 9))
# 40 host slots (max_promotions = 10); the queue's chunks are stored first, then a hot
# 8-chunk request alternates with one-chunk fillers.
CONFIG = {"cpu_bytes_to_use": 40 * CHUNK_BYTES, "secondary_tiers": [{"type": "memory"}]}
RUN = [mooncake([c]) for c in QUEUED] + [
    line for j in range(30) for line in (mooncake(HOT), mooncake([200 + j]))]


def replay(path, waiting: int):
    requests = read_trace(path)
    options = ReplayOptions(PRESETS["tiny"], device_bytes=8 * CHUNK_BYTES, waiting=waiting)
    ran = requests[:len(requests) - waiting]
    return run_replay(requests, reference_hits(ran, CHUNK), CONFIG, options, str(path))


def test_a_waiting_queue_does_not_evict_the_hot_chunks(write_trace):
    alone = replay(write_trace(RUN, "alone.jsonl"), waiting=0)
    queued = replay(write_trace(RUN + [mooncake([c]) for c in QUEUED], "queued.jsonl"),
                    waiting=100)
    assert alone.hit_tokens["memory"] == 0
    assert queued.hit_tokens == alone.hit_tokens
    assert queued.total_hit_tokens == queued.reference.hit_tokens


class FaultyManager(Manager):
    """Promotions unbounded (the storm kvhal prevents)."""

    __init__ = functools.partialmethod(Manager.__init__, max_promotions=1 << 30)


def test_without_the_bound_the_queue_evicts_them(write_trace, monkeypatch):
    """The test above can fail: unbounded promotions, landing as most recently used."""
    monkeypatch.setattr("kvhal.engine.build.Manager", FaultyManager)
    commit = SlotTable.commit
    monkeypatch.setattr(SlotTable, "commit", lambda self, slot, cold=False: commit(self, slot))
    queued = replay(write_trace(RUN + [mooncake([c]) for c in QUEUED], "queued.jsonl"),
                    waiting=100)
    assert queued.hit_tokens["memory"] > 0
