"""`kvhal_job_finished`: a plugin registered with kvhal's plugin manager hears every job the
engine ends, once, with what it moved and how it ended."""
from __future__ import annotations

import pytest

from kvhal import plugins
from kvhal.engine import FinishedJob
from kvhal.hookspecs import hookimpl

from .rig import make_rig, synthetic_keys


class JobObserver:
    """A plugin as a third party writes one: a class with the hook implementation."""

    def __init__(self) -> None:
        self.jobs: list[FinishedJob] = []

    @hookimpl
    def kvhal_job_finished(self, job: FinishedJob) -> None:
        self.jobs.append(job)


@pytest.fixture
def observer():
    seen = JobObserver()
    manager = plugins.plugin_manager()
    manager.register(seen, name="test-job-observer")
    yield seen
    manager.unregister(seen)


def test_every_host_and_tier_job_reaches_a_registered_plugin_once(observer):
    rig = make_rig(capacity=4, blocks_per_chunk=1, block_bytes=256, num_blocks=8,
                   tiers=[{"type": "memory"}])
    try:
        a, b, c = synthetic_keys(3)
        store = rig.manager.prepare_store([a, b, c])
        rig.manager.complete_store(store.job_id, 2)            # c failed on its way to host
        rig.manager.drain()                                    # a and b cascade to the tier
        load = rig.manager.prepare_load([a, b])
        rig.manager.complete_load(load.job_id)
        rig.manager.poll()                                     # nothing more to announce
        label = rig.manager.tier_labels[0]
    finally:
        rig.close()

    host_store, *cascades, host_load = observer.jobs
    assert (host_store.tier, host_store.kind, host_store.job_id, host_store.keys,
            host_store.num_ok, host_store.error, host_store.ok) == (
        "host", "store", store.job_id, (a, b, c), 2, None, False)
    assert {j.keys: (j.tier, j.kind, j.num_ok, j.error, j.ok) for j in cascades} == {
        (a,): (label, "store", 1, None, True), (b,): (label, "store", 1, None, True)}
    assert len({j.job_id for j in cascades}) == 2
    assert (host_load.tier, host_load.kind, host_load.job_id, host_load.keys, host_load.num_ok,
            host_load.ok) == ("host", "load", load.job_id, (a, b), 2, True)
    assert all(j.seconds >= 0 for j in observer.jobs)


def test_a_failed_tier_job_carries_its_reason(observer, tmp_path):
    rig = make_rig(capacity=1, blocks_per_chunk=1, block_bytes=256, num_blocks=8,
                   tiers=[{"type": "fs", "root_dir": str(tmp_path), "max_bytes": 4096}])
    try:
        (a,) = synthetic_keys(1)
        store = rig.manager.prepare_store([a])
        rig.manager.complete_store(store.job_id)
        rig.manager.drain()
    finally:
        rig.close()

    tier_job = observer.jobs[-1]
    assert (tier_job.kind, tier_job.keys, tier_job.num_ok, tier_job.ok) == ("store", (a,), 0,
                                                                          False)
    assert "exceeds max_bytes 4096" in tier_job.error


def test_nothing_is_built_while_no_plugin_listens(monkeypatch):
    built = []
    monkeypatch.setattr("kvhal.engine.manager.FinishedJob",
                        lambda *args: built.append(args))
    rig = make_rig(capacity=2, blocks_per_chunk=1, block_bytes=256, num_blocks=8,
                   tiers=[{"type": "memory"}])
    try:
        (a,) = synthetic_keys(1)
        rig.manager.complete_store(rig.manager.prepare_store([a]).job_id)
        rig.manager.drain()
    finally:
        rig.close()
    assert not plugins.job_listeners() and built == []
