"""Metrics of the engine (DESIGN §8): one table of figures per tier, two ways out.

Every engine (`Manager`) owns an `EngineMetrics`: cumulative counts per tier label, latency
histograms and the tiers' sizes. They leave the engine
- as Prometheus `kvhal_<name>` series (label `tier`, plus `result` or `kind`), summed over every
  engine of the process by one collector registered in prometheus-client's default registry at
  import (so two engines in one process never register a metric twice);
- as deltas (`EngineMetrics.take_delta`) that an integration ships across processes; vLLM's
  connector turns them into `vllm:kv_offload_<name>` series on vLLM's own `/metrics`
  (`kvhal.integrations.vllm.stats`).

`tier` is "host" for the host tier, else the secondary tier's type name, suffixed "-2", "-3", ...
for a second, third tier of one type (`tier_labels`). Counts only grow: every counter is
incremented by a count ≥ 0, once per call, never once per chunk.
"""
from __future__ import annotations

import bisect
import threading
import weakref
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Sequence

from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily, \
    HistogramMetricFamily

from kvhal.events import HOST_TIER as HOST

#: Upper bounds (seconds) of the latency histograms: a host job (D2H/H2D of a few chunks,
#: sub-millisecond to tens of ms) up to a slow object-store GET.
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                     2.5, 5.0, 10.0)


@dataclass(frozen=True, slots=True)
class MetricDef:
    """One figure: `kind` counter | histogram | gauge, its labels after `tier`, its help."""

    kind: str
    labels: tuple[str, ...]
    doc: str


#: Every figure, by name (the suffix of `kvhal_<name>` and `vllm:kv_offload_<name>`; vLLM's
#: own offloading connector uses `load_bytes` and `store_bytes` for the same figures).
METRICS: dict[str, MetricDef] = {
    "chunk_lookups": MetricDef("counter", ("result",),
                               "Chunks looked up, by answer (hit, miss, retry)"),
    "stored_chunks": MetricDef("counter", (), "Chunks that became readable in a tier"),
    "loaded_chunks": MetricDef("counter", (), "Chunks loaded from a tier (host: to the device; "
                               "secondary: promoted into the host tier)"),
    "evicted_chunks": MetricDef("counter", (), "Chunks that left a tier (evicted, garbage-"
                                "collected, discarded, found corrupt or missing)"),
    "failed_chunks": MetricDef("counter", ("kind",),
                               "Chunks whose transfer failed, by direction (store, load)"),
    "skipped_chunks": MetricDef("counter", (), "Chunks due for storing that never got a slot "
                                "before their request ended (the host tier is smaller than "
                                "one step's stores)"),
    "cost_skipped_tokens": MetricDef("counter", (), "Tokens a secondary tier held that the "
                                     "cost model left to recompute (its load was predicted "
                                     "slower), once per request"),
    "store_bytes": MetricDef("counter", (), "Payload bytes stored into a tier"),
    "load_bytes": MetricDef("counter", (), "Payload bytes loaded from a tier"),
    "store_latency_seconds": MetricDef("histogram", (), "Wall time of one store job (host: "
                                       "prepare to complete, as the scheduler sees it)"),
    "load_latency_seconds": MetricDef("histogram", (), "Wall time of one load job (host: "
                                      "prepare to complete, as the scheduler sees it)"),
    "used_bytes": MetricDef("gauge", (), "Bytes a tier holds now"),
    "capacity_bytes": MetricDef("gauge", (), "Bytes a tier may hold"),
}


def tier_labels(names: Sequence[str]) -> list[str]:
    """Unique `tier` label values for secondary tiers of type `names`, in order: the type name,
    then "<type>-2", "<type>-3", ... for repeats ("host" is reserved for the host tier)."""
    seen: Counter[str] = Counter()
    out = []
    for name in names:
        seen[name] += 1
        out.append(name if seen[name] == 1 and name != HOST else f"{name}-{seen[name]}")
    return out


#: Sizes callback: tier label → (used bytes, capacity bytes).
SizesFn = Callable[[], Mapping[str, tuple[int, int]]]


class EngineMetrics:
    """The figures of one engine (see the module docstring).

    Args:
        sizes: Returns each tier's (used, capacity) bytes now; called at export, from any
            thread.
        tier_metrics: The secondary tiers' own metrics (`kvhal.tier_metrics.TierMetrics`,
            exported by their own collector), shipped by `take_delta` too.

    Threading: `count`/`observe` are called from the engine's thread; `take_delta` from the
    same thread; the Prometheus collector reads totals from the scrape thread under a lock.
    """

    def __init__(self, sizes: SizesFn, tier_metrics: Sequence = ()):
        self._sizes = sizes
        self._tier_metrics = tuple(tier_metrics)
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str, str]] = Counter()   # (name, tier, label) → n
        self._hist: dict[tuple[str, str], list[float]] = {}     # buckets + [sum, count]
        self._samples: defaultdict[tuple[str, str], list[float]] = defaultdict(list)
        self._taken: Counter[tuple[str, str, str]] = Counter()
        self._keep_samples = False
        _ENGINES.add(self)

    @property
    def keep_samples(self) -> bool:
        """Whether latency samples (and the tiers' histogram samples) are kept for
        `take_delta` (an integration that ships them sets it)."""
        return self._keep_samples

    @keep_samples.setter
    def keep_samples(self, keep: bool) -> None:
        self._keep_samples = keep
        for tier in self._tier_metrics:
            tier.keep_samples[0] = keep

    def count(self, name: str, tier: str, n: int = 1, label: str = "") -> None:
        """Add `n` (≥ 0) to counter `name` of `tier` (label value `label` for `result`/`kind`)."""
        if n > 0:
            with self._lock:
                self._counts[(name, tier, label)] += n

    def observe(self, name: str, tier: str, seconds: float) -> None:
        """Record one latency sample of histogram `name` for `tier`."""
        with self._lock:
            h = self._hist.get((name, tier))
            if h is None:
                h = self._hist[(name, tier)] = [0.0] * (len(LATENCY_BUCKETS_S) + 3)
            h[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
            h[-2] += seconds
            h[-1] += 1
            if self._keep_samples:
                self._samples[(name, tier)].append(seconds)

    def totals(self) -> dict[tuple[str, str, str], int]:
        """Cumulative counts, (name, tier, label) → n."""
        with self._lock:
            return dict(self._counts)

    def take_delta(self) -> dict[str, dict[str, dict[str, float | list[float]]]]:
        """What changed since the last call, as plain data (str keys, numbers, lists):
        `{"counters": {name: {"tier" or "tier,label": n}}, "samples": {name: {tier: [s, ...]}},
        "gauges": {name: {tier: bytes}}, "tier_metrics": [block, ...]}` (the tiers' own
        metrics, `TierMetrics.take_delta`); empty sections are left out. Latency samples are kept
        between calls only once `keep_samples` is set (an integration that ships them)."""
        with self._lock:
            counts, samples = dict(self._counts), self._samples
            self._samples = defaultdict(list)
            delta = {k: n - self._taken[k] for k, n in counts.items() if n > self._taken[k]}
            self._taken = Counter(counts)
        out: dict = {}
        for (name, tier, label), n in delta.items():
            out.setdefault("counters", {}).setdefault(name, {})[
                f"{tier},{label}" if label else tier] = n
        for (name, tier), values in samples.items():
            out.setdefault("samples", {}).setdefault(name, {})[tier] = values
        for tier, (used, capacity) in self._sizes().items():
            gauges = out.setdefault("gauges", {})
            gauges.setdefault("used_bytes", {})[tier] = used
            gauges.setdefault("capacity_bytes", {})[tier] = capacity
        blocks = [block for tier in self._tier_metrics for block in tier.take_delta()]
        if blocks:
            out["tier_metrics"] = blocks
        return out

    def _histograms(self) -> dict[tuple[str, str], list[float]]:
        with self._lock:
            return {k: list(v) for k, v in self._hist.items()}


_ENGINES: weakref.WeakSet[EngineMetrics] = weakref.WeakSet()


class _Collector:
    """Sums every live engine's figures into `kvhal_*` series at scrape time."""

    def collect(self) -> Iterator:
        engines = list(_ENGINES)
        counts: Counter[tuple[str, str, str]] = Counter()
        hists: dict[tuple[str, str], list[float]] = {}
        sizes: Counter[tuple[str, str]] = Counter()
        for engine in engines:
            counts.update(engine.totals())
            for key, h in engine._histograms().items():
                acc = hists.setdefault(key, [0.0] * len(h))
                for i, v in enumerate(h):
                    acc[i] += v
            for tier, (used, capacity) in engine._sizes().items():
                sizes[("used_bytes", tier)] += used
                sizes[("capacity_bytes", tier)] += capacity
        for name, spec in METRICS.items():
            labels = ["tier", *spec.labels]
            if spec.kind == "counter":
                family = CounterMetricFamily(f"kvhal_{name}", spec.doc, labels=labels)
                for (n, tier, label), value in sorted(counts.items()):
                    if n == name:
                        family.add_metric([tier, label] if spec.labels else [tier], value)
            elif spec.kind == "histogram":
                family = HistogramMetricFamily(f"kvhal_{name}", spec.doc, labels=labels)
                for (n, tier), h in sorted(hists.items()):
                    if n == name:
                        cumulative, buckets = 0.0, []
                        for bound, c in zip((*LATENCY_BUCKETS_S, float("inf")), h):
                            cumulative += c
                            buckets.append((_bound(bound), cumulative))
                        family.add_metric([tier], buckets, h[-2])
            else:
                family = GaugeMetricFamily(f"kvhal_{name}", spec.doc, labels=labels)
                for (n, tier), value in sorted(sizes.items()):
                    if n == name:
                        family.add_metric([tier], value)
            yield family


def _bound(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


REGISTRY.register(_Collector())
