"""A tier's own event kinds (`SecondaryTier.publish_event`) reach `kvhal_kv_event`
subscribers, never the engine's event queue that vLLM's publisher forwards."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvhal import plugins
from kvhal.events import BlockStored
from kvhal.hookspecs import hookimpl
from kvhal.tiers.memory import MemoryTier

from .rig import chunk_blocks, make_rig, synthetic_keys


@dataclass(frozen=True, slots=True)
class ChunkAdmitted:
    """The event kind of `AnnouncingTier`: one chunk entered it."""

    tier: str
    block_hash: bytes


class AnnouncingTier(MemoryTier):
    """The memory tier, publishing a `ChunkAdmitted` per chunk it stores."""

    name = "announcing_mem"

    def submit_store(self, job):
        super().submit_store(job)
        self.publish_event(ChunkAdmitted(self.metrics.label, job.key.block_hash))


class EventObserver:
    """A plugin that records every KV event it hears."""

    def __init__(self) -> None:
        self.events: list = []

    @hookimpl
    def kvhal_kv_event(self, event) -> None:
        self.events.append(event)


@pytest.fixture
def observer():
    seen = EventObserver()
    manager = plugins.plugin_manager()
    manager.register(seen, name="test-tier-event-observer")
    yield seen
    manager.unregister(seen)


def test_a_tiers_own_events_reach_subscribers_only(observer):
    rig = make_rig(capacity=4, blocks_per_chunk=1, block_bytes=64, num_blocks=8,
                   tiers=[{"type": "announcing_mem",
                           "module_path": f"{__name__}:AnnouncingTier"}])
    try:
        keys = synthetic_keys(2)
        rig.store(keys, chunk_blocks(0, 2, 1))
        rig.manager.poll()
        rig.manager.poll()
        queued = rig.manager.take_events()
    finally:
        rig.close()
    assert [e for e in observer.events if isinstance(e, ChunkAdmitted)] == [
        ChunkAdmitted("announcing_mem", k.block_hash) for k in keys]
    assert not any(isinstance(e, ChunkAdmitted) for e in queued)
    assert {e.tier for e in queued if isinstance(e, BlockStored)} == {"host", "announcing_mem"}
