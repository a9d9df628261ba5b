"""Engine metrics move by exactly the chunks each operation handled, in both exports: the
process-wide `kvhal_*` Prometheus series and the deltas an integration ships."""
from __future__ import annotations

from prometheus_client import REGISTRY

from kvhal.metrics import LATENCY_BUCKETS_S, tier_labels

from .rig import chunk_blocks, make_rig, synthetic_keys

TIERS = ("host", "memory")


def _samples():
    """Every kvhal_* counter sample of the default registry, by (name, labels)."""
    out = {}
    for family in REGISTRY.collect():
        if family.name.startswith("kvhal_") and family.type == "counter":
            for s in family.samples:
                if s.name.endswith("_total"):
                    out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _run(rig):
    keys = synthetic_keys(4)
    rig.store(keys[:3], chunk_blocks(0, 3, 1))            # 3 stored in host
    rig.manager.poll()                                    # 3 cascaded to memory
    plan = rig.manager.prepare_store(keys[3:])            # evicts keys[0]
    rig.manager.complete_store(plan.job_id, 0)            # 1 failed store
    rig.manager.lookup(keys)                              # retry (promoting), 2 hits, miss
    rig.manager.lookup(keys)                              # landed: 3 hits, 1 miss
    plan = rig.manager.prepare_load(keys[:3])
    assert plan.sources == ("memory", "host", "host")     # keys[0] came back by promotion
    rig.manager.complete_load(plan.job_id, 2)             # 2 loaded, 1 failed


WANT = {("chunk_lookups", "host", "hit"): 5, ("chunk_lookups", "host", "retry"): 1,
        ("chunk_lookups", "host", "miss"): 2, ("chunk_lookups", "memory", "hit"): 1,
        ("chunk_lookups", "memory", "miss"): 2,
        ("failed_chunks", "host", "store"): 1, ("failed_chunks", "host", "load"): 1,
        ("stored_chunks", "host", ""): 4, ("stored_chunks", "memory", ""): 3,
        ("loaded_chunks", "host", ""): 2, ("loaded_chunks", "memory", ""): 1,
        ("evicted_chunks", "host", ""): 1,
        ("store_bytes", "host", ""): 3 * 64, ("store_bytes", "memory", ""): 3 * 64,
        ("load_bytes", "host", ""): 2 * 64, ("load_bytes", "memory", ""): 64}


def test_prometheus_counters_follow_the_operations():
    rig = make_rig(capacity=3, blocks_per_chunk=1, block_bytes=64, num_blocks=16,
                   tiers=[{"type": "memory"}])
    try:
        before = _samples()
        _run(rig)
        after = _samples()
    finally:
        rig.close()
    delta = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    want = {}
    for (name, tier, label), n in WANT.items():
        labels = {"tier": tier} | ({"kind" if name == "failed_chunks" else "result": label}
                                   if label else {})
        want[(f"kvhal_{name}_total", tuple(sorted(labels.items())))] = n
    assert delta == want


def test_deltas_carry_counts_latencies_and_sizes_once():
    rig = make_rig(capacity=3, blocks_per_chunk=1, block_bytes=64, num_blocks=16,
                   tiers=[{"type": "memory", "max_bytes": 1000}])
    rig.manager.metrics.keep_samples = True
    try:
        _run(rig)
        delta = rig.manager.metrics.take_delta()
        again = rig.manager.metrics.take_delta()
    finally:
        rig.close()
    want: dict = {}
    for (name, tier, label), n in WANT.items():
        want.setdefault(name, {})[f"{tier},{label}" if label else tier] = n
    assert delta["counters"] == want
    # host: 2 store jobs + 1 load job; memory: 3 cascades + 1 promotion
    assert {n: {t: len(v) for t, v in by.items()} for n, by in delta["samples"].items()} == {
        "store_latency_seconds": {"host": 2, "memory": 3},
        "load_latency_seconds": {"host": 1, "memory": 1}}
    slot = rig.manager.slot_bytes
    assert delta["gauges"] == {"used_bytes": {"host": 3 * slot, "memory": 3 * 64},
                               "capacity_bytes": {"host": 3 * slot, "memory": 1000}}
    assert again == {"gauges": delta["gauges"]}                # counts and samples went once


def _buckets(tier: str) -> dict[str, float]:
    (family,) = [f for f in REGISTRY.collect() if f.name == "kvhal_load_latency_seconds"]
    return {s.labels["le"]: s.value for s in family.samples
            if s.name.endswith("_bucket") and s.labels["tier"] == tier}


def test_latency_histogram_buckets_every_sample():
    rig = make_rig(capacity=3, blocks_per_chunk=1, block_bytes=64, num_blocks=16)
    try:
        for seconds in (0.0001, 0.003, 99.0):
            rig.manager.metrics.observe("load_latency_seconds", "test-tier", seconds)
        buckets = _buckets("test-tier")
    finally:
        rig.close()
    assert len(buckets) == len(LATENCY_BUCKETS_S) + 1
    assert (buckets["0.0005"], buckets["0.0025"], buckets["0.005"], buckets["10.0"],
            buckets["+Inf"]) == (1, 1, 2, 2, 3)


def test_repeated_tier_types_get_distinct_labels():
    assert tier_labels(["fs", "obj", "fs", "fs", "host"]) == ["fs", "obj", "fs-2", "fs-3",
                                                               "host-1"]
