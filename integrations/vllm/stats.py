"""kvhal's figures on vLLM's own `/metrics`, through vLLM's connector-stats mechanism.

vLLM 0.32 (`distributed/kv_transfer/kv_connector/v1/metrics.py`, `v1/core/sched/scheduler.py`):
each engine step the scheduler asks its connector for `get_kv_connector_stats()`, ships
`stats.to_dict()` to the API-server process inside `SchedulerStats`, and there rebuilds it with
the connector class's `build_kv_connector_stats(data)` (log lines, `reduce`) and feeds it to the
object `build_prom_metrics(...)` made (`observe(data, engine_idx)`). kvhal's payload is one
`EngineMetrics.take_delta()` of the scheduler-side manager, so counters only ever grow by what
happened since the last step, and the series are made once per API-server process with vLLM's
own metric classes and labels (`model_name`, `engine`) plus `tier` (and `result`/`kind`).

The tiers' own metrics (`kvhal.tier_metrics`) ride in the payload's "tier_metrics" blocks, each
with its declaration: their `vllm:kv_offload_<tier>_<name>` series are made on first sight, and
a block whose declaration differs from the one first seen for its series (another engine
process running another version of the tier: a kind or a label changed) is refused with one
error naming the tier's series, its figures dropped.
"""
from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (KVConnectorPromMetrics,
                                                                  KVConnectorStats)
from kvhal.metrics import LATENCY_BUCKETS_S, METRICS

#: Prefix of every series on vLLM's `/metrics` (vLLM's offloading family).
PREFIX = "vllm:kv_offload_"
_SECTIONS = ("counters", "samples", "gauges")
#: The tiers' own metrics: a list of `TierMetrics.take_delta` blocks.
_TIERS = "tier_metrics"
log = logging.getLogger(__name__)


class KVHalStats(KVConnectorStats):
    """One or more merged `EngineMetrics.take_delta()` payloads (`data`, plain dicts)."""

    def reset(self) -> None:
        """Forget every figure."""
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Merge `other` in: counters add, latency samples concatenate, sizes take `other`'s
        (the later snapshot)."""
        for section in _SECTIONS:
            for name, by_label in other.data.get(section, {}).items():
                mine = self.data.setdefault(section, {}).setdefault(name, {})
                for label, value in by_label.items():
                    if section == "counters":
                        mine[label] = mine.get(label, 0) + value
                    elif section == "samples":
                        mine[label] = [*mine.get(label, ()), *value]
                    else:
                        mine[label] = value
        if other.data.get(_TIERS):
            self.data[_TIERS] = [*self.data.get(_TIERS, ()), *other.data[_TIERS]]
        return self

    def reduce(self) -> dict[str, int | float]:
        """Flat summary for vLLM's periodic log line: counter totals and sample counts/means,
        keyed `name[labels]`."""
        out: dict[str, int | float] = {}
        for name, by_label in self.data.get("counters", {}).items():
            for label, value in by_label.items():
                out[f"{name}[{label}]"] = value
        for name, by_label in self.data.get("samples", {}).items():
            for label, values in by_label.items():
                out[f"{name}[{label}]_count"] = len(values)
                out[f"{name}[{label}]_mean"] = sum(values) / len(values) if values else 0.0
        for block in self.data.get(_TIERS, ()):
            if block["decl"][0] == "counter":
                for labels, value in block["values"]:
                    key = f"{block['family']}[{','.join(labels)}]"
                    out[key] = out.get(key, 0) + value
        return out

    def is_empty(self) -> bool:
        """True when no section holds a figure."""
        return not any(self.data.get(section) for section in (*_SECTIONS, _TIERS))


class KVHalPromMetrics(KVConnectorPromMetrics):
    """`vllm:kv_offload_<name>` series for every figure of `kvhal.metrics.METRICS`.

    Args (from vLLM's `KVConnectorProm`):
        vllm_config: The engine config.
        metric_types: vLLM's classes for `Gauge`, `Counter`, `Histogram` (prometheus-client's
            or Ray's wrappers).
        labelnames: vLLM's labels (`model_name`, `engine`).
        per_engine_labelvalues: engine index → values of `labelnames`.
    """

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        classes = {"counter": self._counter_cls, "gauge": self._gauge_cls,
                   "histogram": self._histogram_cls}
        self._series: dict[str, Any] = {}
        for name, spec in METRICS.items():
            kwargs = {"buckets": LATENCY_BUCKETS_S} if spec.kind == "histogram" else {}
            self._series[name] = classes[spec.kind](
                name=PREFIX + name, documentation=f"kvhal: {spec.doc}",
                labelnames=[*labelnames, "tier", *spec.labels], **kwargs)
        self._bound: dict[tuple[int, str, str], Any] = {}
        self._classes = classes
        self._labelnames = list(labelnames)
        # the tiers' own series: family → (declaration as first seen, series or None if that
        # declaration was refused); refused declarations already logged
        self._tier_series: dict[str, tuple[list, Any]] = {}
        self._refused: set[tuple[str, str]] = set()

    def _child(self, engine_idx: int, name: str, label: str) -> Any:
        key = (engine_idx, name, label)
        child = self._bound.get(key)
        if child is None:
            values = [*self.per_engine_labelvalues[engine_idx], *label.split(",")]
            child = self._bound[key] = self._series[name].labels(*values)
        return child

    def _tier_family(self, block: dict[str, Any], engine_idx: int) -> Any:
        """The series of a "tier_metrics" block, made on first sight; None (and one error
        logged) if its declaration differs from the one first seen or is malformed."""
        family, decl = block["family"], block["decl"]
        known = self._tier_series.get(family)
        if known is None:
            try:
                kind, doc, labels, bounds = decl
                kwargs = {"buckets": list(bounds)} if kind == "histogram" else {}
                series = self._classes[kind](
                    name=PREFIX + family, documentation=f"kvhal tier: {doc}",
                    labelnames=[*self._labelnames, "tier", *labels], **kwargs)
            except (KeyError, TypeError, ValueError) as exc:
                log.error("kvhal tier metric %s%s: declaration %r refused (%s); its figures "
                          "are dropped", PREFIX, family, decl, exc)
                series = None
            known = self._tier_series[family] = (decl, series)
        if known[0] != decl:
            if (family, repr(decl)) not in self._refused:
                self._refused.add((family, repr(decl)))
                log.error("kvhal tier metric %s%s: engine %d declares it %r, but it was first "
                          "declared %r (processes run different versions of the tier?); "
                          "engine %d's figures of it are dropped", PREFIX, family, engine_idx,
                          decl, known[0], engine_idx)
            return None
        return known[1]

    def _observe_tiers(self, blocks: list[dict[str, Any]], engine_idx: int) -> None:
        """Apply each block; a malformed one (another kvhal version's format) is dropped with
        one error per family and fault, never raised into vLLM's output loop."""
        values_of_engine = self.per_engine_labelvalues[engine_idx]
        for block in blocks:
            try:
                series = self._tier_family(block, engine_idx)
                if series is None:
                    continue
                kind = block["decl"][0]
                for labels, value in block["values"]:
                    child = series.labels(*values_of_engine, *labels)
                    if kind == "counter":
                        if value > 0:
                            child.inc(value)
                    elif kind == "histogram":
                        for sample in value:
                            child.observe(sample)
                    else:
                        child.set(value)
            except (KeyError, TypeError, ValueError, IndexError) as exc:
                family = block.get("family") if isinstance(block, dict) else None
                fault = (str(family), type(exc).__name__)
                if fault not in self._refused:
                    self._refused.add(fault)
                    log.error("kvhal tier metric %s%s: engine %d shipped a malformed block "
                              "(%s: %s; another kvhal version?); such blocks are dropped",
                              PREFIX, family, engine_idx, type(exc).__name__, exc)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Apply one payload: counters `inc` by their (≥ 0) deltas, samples `observe`d,
        sizes `set`, the tiers' own blocks likewise by their declared kind. Names outside
        `METRICS` (a newer engine) are skipped."""
        self._observe_tiers(transfer_stats_data.get(_TIERS, ()), engine_idx)
        for section in _SECTIONS:
            for name, by_label in transfer_stats_data.get(section, {}).items():
                if name not in self._series:
                    continue
                for label, value in by_label.items():
                    child = self._child(engine_idx, name, label)
                    if section == "counters":
                        if value > 0:
                            child.inc(value)
                    elif section == "samples":
                        for seconds in value:
                            child.observe(seconds)
                    else:
                        child.set(value)
