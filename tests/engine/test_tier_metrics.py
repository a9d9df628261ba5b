"""A tier's own metrics: declared by the tier, exposed as `kvhal_<tier>_<name>` and shipped in
the engine's deltas; bad declarations refused naming tier and metric."""
from __future__ import annotations

import threading

import pytest
from prometheus_client import REGISTRY

from kvhal.config import ConfigError
from kvhal.tier_metrics import OTHER, MetricDeclarationError, MetricSpec, TierMetrics
from kvhal.tiers.memory import MemoryTier

from .rig import chunk_blocks, make_rig, synthetic_keys


class MeteredMemory(MemoryTier):
    """The memory tier with metrics of its own (a tier written outside kvhal would look the
    same): store jobs by outcome, their wall time, chunks held."""

    name = "metered_mem"
    metric_specs = (
        MetricSpec("stores", "counter", "Store jobs by outcome", labels={"outcome": ("ok", "error")}),
        MetricSpec("store_seconds", "histogram", "Wall time of a store job, seconds",
                   buckets=(0.5, 1.0)),
        MetricSpec("held_chunks", "gauge", "Chunks held now"),
    )

    def get_finished_jobs(self):
        done = super().get_finished_jobs()
        for result in done:
            if result.kind.value == "store":
                self.metrics["stores"].labels("ok" if result.ok else "error").inc()
                self.metrics["store_seconds"].observe(0.25)
        self.metrics["held_chunks"].set(len(self._data))
        return done


def _value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_declared_metrics_reach_prometheus_and_the_deltas():
    rig = make_rig(capacity=3, blocks_per_chunk=1, block_bytes=64, num_blocks=16,
                   tiers=[{"type": "metered_mem", "module_path":
                           f"{__name__}:MeteredMemory"}] * 2)
    rig.manager.metrics.keep_samples = True
    try:
        keys = synthetic_keys(3)
        rig.store(keys, chunk_blocks(0, 3, 1))
        rig.manager.poll()                                     # 3 cascaded to each tier
        rig.manager.poll()
        delta = rig.manager.metrics.take_delta()
        again = rig.manager.metrics.take_delta()
        assert _value("kvhal_metered_mem_stores_total", tier="metered_mem", outcome="ok") == 3
        assert _value("kvhal_metered_mem_stores_total", tier="metered_mem-2",
                      outcome="ok") == 3
        assert _value("kvhal_metered_mem_store_seconds_bucket", tier="metered_mem",
                      le="0.5") == 3
        assert _value("kvhal_metered_mem_store_seconds_sum", tier="metered_mem") == 0.75
        assert _value("kvhal_metered_mem_held_chunks", tier="metered_mem-2") == 3
    finally:
        rig.close()
    blocks = {(b["family"], tuple(map(tuple, (v[0] for v in b["values"])))): b
              for b in delta["tier_metrics"]}
    stores = blocks[("metered_mem_stores", (("metered_mem", "ok"),))]
    assert stores["decl"] == ["counter", "Store jobs by outcome", ["outcome"], []]
    assert stores["values"] == [[["metered_mem", "ok"], 3.0]]
    hist = blocks[("metered_mem_store_seconds", (("metered_mem-2",),))]
    assert hist["values"] == [[["metered_mem-2"], [0.25, 0.25, 0.25]]]
    # counters and histograms ship only what changed; gauges every time
    assert [b["family"] for b in again["tier_metrics"]] == ["metered_mem_held_chunks"] * 2


BAD = {
    "invalid name": (MetricSpec("bad-name", "counter", "x"), "not a valid Prometheus name"),
    "unknown kind": (MetricSpec("x", "summary", "x"), "kind 'summary'"),
    "counter named _total": (MetricSpec("x_total", "counter", "x"), "'_total'"),
    "no help": (MetricSpec("x", "gauge", " "), "help"),
    "unbounded label": (MetricSpec("x", "counter", "x", labels={"peer": None}), "no bound"),
    "reserved label": (MetricSpec("x", "counter", "x", labels={"tier": ("a",)}), "reserved"),
    "zero max": (MetricSpec("x", "counter", "x", labels={"peer": 0}), "max must be"),
    "buckets out of order": (MetricSpec("x", "histogram", "x", buckets=(1.0, 0.5)),
                             "strictly increasing"),
    "buckets on a gauge": (MetricSpec("x", "gauge", "x", buckets=(1.0,)), "for histograms"),
}


@pytest.mark.parametrize("case", list(BAD), ids=str)
def test_bad_declarations_are_refused_naming_tier_and_metric(case):
    spec, why = BAD[case]
    with pytest.raises(MetricDeclarationError) as err:
        TierMetrics("refused_tier", (spec,))
    assert f"tier 'refused_tier' metric {spec.name!r}" in str(err.value)
    assert why in str(err.value)


def test_a_series_clashing_with_a_builtin_is_refused():
    # kvhal_store_bytes is the built-in `store_bytes` counter
    with pytest.raises(MetricDeclarationError, match="tier 'store' metric 'bytes'.*built-in"):
        TierMetrics("store", (MetricSpec("bytes", "counter", "x"),))


def test_a_series_clashing_with_another_tiers_is_refused():
    TierMetrics("clash_a", (MetricSpec("b_c", "gauge", "x"),))
    TierMetrics("clash_a", (MetricSpec("b_c", "gauge", "x"),))   # a second instance: fine
    with pytest.raises(MetricDeclarationError,
                       match="tier 'clash_a_b' metric 'c'.*kvhal_clash_a_b_c.*tier 'clash_a'"):
        TierMetrics("clash_a_b", (MetricSpec("c", "counter", "x"),))
    with pytest.raises(MetricDeclarationError, match="already declared by tier 'clash_a'"):
        TierMetrics("clash_a", (MetricSpec("b_c", "counter", "x"),))  # kind changed


class UnboundedTier(MemoryTier):
    """A tier whose label has no bound (refused when the engine starts)."""

    name = "unbounded_mem"
    metric_specs = (MetricSpec("pulls", "counter", "Pulls by peer", labels={"peer": None}),)


def test_the_engine_refuses_a_bad_declaration_at_start():
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\].*tier 'unbounded_mem' "
                                          r"metric 'pulls'.*label 'peer' has no bound"):
        make_rig(tiers=[{"type": "unbounded_mem", "module_path": f"{__name__}:UnboundedTier"}])


def test_label_values_beyond_the_max_are_counted_as_other():
    metrics = TierMetrics("capped_tier", (MetricSpec("pulls", "counter", "Pulls by peer",
                                                     labels={"peer": 2}),))
    for peer in ("a", "b", "c", "d", "a"):
        metrics["pulls"].labels(peer=peer).inc()
    assert {k: c.value for k, c in metrics["pulls"].series().items()} == {
        ("a",): 2, ("b",): 1, (OTHER,): 2}
    assert len(metrics["pulls"]._children) == 2      # "c", "d" not remembered: memory bounded
    with pytest.raises(ValueError, match="label 'outcome' value 'maybe' is not one of"):
        TierMetrics("strict_tier", (MetricSpec("x", "counter", "x", labels={
            "outcome": ("ok",)}),))["x"].labels(outcome="maybe")


def test_updates_from_many_threads_are_all_counted():
    metrics = TierMetrics("threaded_tier", (MetricSpec("ops", "counter", "x"),))
    counter = metrics["ops"]

    def work():
        for _ in range(20_000):
            counter.inc()
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert _value("kvhal_threaded_tier_ops_total", tier="threaded_tier") == 80_000
