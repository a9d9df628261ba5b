"""kvhal's figures on vLLM's own `/metrics`, through vLLM's connector-stats mechanism.

vLLM 0.32 (`distributed/kv_transfer/kv_connector/v1/metrics.py`, `v1/core/sched/scheduler.py`):
each engine step the scheduler asks its connector for `get_kv_connector_stats()`, ships
`stats.to_dict()` to the API-server process inside `SchedulerStats`, and there rebuilds it with
the connector class's `build_kv_connector_stats(data)` (log lines, `reduce`) and feeds it to the
object `build_prom_metrics(...)` made (`observe(data, engine_idx)`). kvhal's payload is one
`EngineMetrics.take_delta()` of the scheduler-side manager, so counters only ever grow by what
happened since the last step, and the series are made once per API-server process with vLLM's
own metric classes and labels (`model_name`, `engine`) plus `tier` (and `result`/`kind`).
"""
from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (KVConnectorPromMetrics,
                                                                  KVConnectorStats)
from kvhal.metrics import LATENCY_BUCKETS_S, METRICS

#: Prefix of every series on vLLM's `/metrics` (vLLM's offloading family).
PREFIX = "vllm:kv_offload_"
_SECTIONS = ("counters", "samples", "gauges")


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
        return out

    def is_empty(self) -> bool:
        """True when no section holds a figure."""
        return not any(self.data.get(section) for section in _SECTIONS)


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

    def _child(self, engine_idx: int, name: str, label: str) -> Any:
        key = (engine_idx, name, label)
        child = self._bound.get(key)
        if child is None:
            values = [*self.per_engine_labelvalues[engine_idx], *label.split(",")]
            child = self._bound[key] = self._series[name].labels(*values)
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Apply one payload: counters `inc` by their (≥ 0) deltas, samples `observe`d,
        sizes `set`. Names outside `METRICS` (a newer engine) are skipped."""
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
