"""Prometheus counters move by exactly the chunks each operation handled."""
from __future__ import annotations

from prometheus_client import REGISTRY

from .rig import chunk_blocks, make_rig, synthetic_keys


def _samples():
    names = {"lookup": ("kvhal_lookup_chunks_total", ("hit", "miss", "retry")),
             "failed": ("kvhal_failed_chunks_total", ("store", "load"))}
    out = {}
    for what, (metric, labels) in names.items():
        key = "result" if what == "lookup" else "kind"
        for tier in ("host", "memory"):
            for label in labels:
                out[f"{what}:{tier}:{label}"] = REGISTRY.get_sample_value(
                    metric, {"tier": tier, key: label}) or 0.0
    for what in ("stored", "loaded", "evicted"):
        for tier in ("host", "memory"):
            out[f"{what}:{tier}"] = REGISTRY.get_sample_value(
                f"kvhal_{what}_chunks_total", {"tier": tier}) or 0.0
    return out


def test_counters_follow_the_operations():
    rig = make_rig(capacity=3, blocks_per_chunk=1, block_bytes=64, num_blocks=16,
                   tiers=[{"type": "memory"}])
    try:
        before = _samples()
        keys = synthetic_keys(4)
        rig.store(keys[:3], chunk_blocks(0, 3, 1))            # 3 stored in host
        rig.manager.poll()                                    # 3 cascaded to memory
        plan = rig.manager.prepare_store(keys[3:])            # evicts keys[0]
        rig.manager.complete_store(plan.job_id, 0)            # 1 failed store
        rig.manager.lookup(keys)                              # retry (promoting), 2 hits, miss
        rig.manager.lookup(keys)                              # landed: 3 hits, 1 miss
        plan = rig.manager.prepare_load(keys[:3])
        rig.manager.complete_load(plan.job_id, 2)             # 2 loaded, 1 failed
        after = _samples()
        delta = {k: after[k] - before[k] for k in after if after[k] != before[k]}
        assert delta == {"lookup:host:hit": 5, "lookup:host:retry": 1, "lookup:host:miss": 2,
                         "failed:host:store": 1, "failed:host:load": 1, "stored:host": 4,
                         "stored:memory": 3, "loaded:host": 2, "loaded:memory": 1,
                         "evicted:host": 1}
    finally:
        rig.close()
