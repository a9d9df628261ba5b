"""A secondary tier's own metrics (DESIGN §8): declared by the tier, exposed by kvhal.

A tier class lists `MetricSpec`s in `SecondaryTier.metric_specs`; its instances update them
through `SecondaryTier.metrics` (a `TierMetrics`), from any thread:

    metric_specs = (MetricSpec("requests", "counter", "S3 requests by operation and outcome",
                               labels={"op": ("get", "put"), "outcome": ("ok", "error")}),)
    ...
    self.metrics["requests"].labels(op="get", outcome="ok").inc()

kvhal exposes each as `kvhal_<tier type>_<name>` in prometheus-client's default registry
(summed over the tier instances of one `tier` label in the process, as the built-in figures of
`kvhal.metrics` are), and ships what changed with the engine's `EngineMetrics.take_delta` so that
vLLM's connector shows it as `vllm:kv_offload_<tier type>_<name>` (its section "tier_metrics").

Every series carries the `tier` label first (the instance's label, `kvhal.metrics.tier_labels`),
then the declared labels. A label's values are bounded: the declaration lists them (a value
outside the list raises `ValueError`) or gives their maximum number (later values are counted
under `OTHER`, with one warning). Declarations are checked when a tier's metrics are first made
(`MetricDeclarationError`, naming the tier and the metric): a name Prometheus refuses, a series
that would clash with a built-in figure or another tier's, a label without a bound, histogram
bounds out of order. The receiving end of `take_delta` refuses a declaration that differs from
the one it first saw for that series (another process declared another kind).

Cost: one uncontended lock per update (`_Child`); the label lookup is a dict lookup, or nothing
for a child kept by the tier (`labels(...)` once).
"""
from __future__ import annotations

import bisect
import logging
import math
import re
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily, \
    HistogramMetricFamily

from kvhal.metrics import LATENCY_BUCKETS_S, METRICS

log = logging.getLogger(__name__)

KINDS = ("counter", "gauge", "histogram")
#: Label value that collects the values beyond a label's `max`.
OTHER = "other"
#: Prefix of the series outside vLLM (the integration maps it to its own).
PREFIX = "kvhal_"
_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
#: Labels a tier may not declare: kvhal's own, vLLM's, Prometheus' histogram label.
RESERVED_LABELS = frozenset({"tier", "model_name", "engine", "le", "quantile"})


#: A label not given by name (never a kept series' key).
_MISSING = object()


class MetricDeclarationError(ValueError):
    """A tier's metric declaration is refused; the message names the tier and the metric."""


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One metric a tier declares.

    Attributes:
        name: Suffix of the series: `kvhal_<tier type>_<name>` ([a-zA-Z_][a-zA-Z0-9_]*; a
            counter's without `_total`, which Prometheus adds).
        kind: "counter" (only grows; `inc`), "gauge" (`set`/`inc`/`dec`) or "histogram"
            (`observe`).
        help: One line saying what is counted, with its unit.
        labels: Label name → its allowed values (a tuple of str), or the most distinct values
            it takes (an int ≥ 1); every label needs one or the other.
        buckets: A histogram's upper bounds, increasing (default: kvhal's latency buckets,
            seconds); None for counters and gauges.
    """

    name: str
    kind: str
    help: str
    labels: Mapping[str, tuple[str, ...] | int] = field(default_factory=dict)
    buckets: tuple[float, ...] | None = None

    def wire(self) -> list:
        """The declaration as plain data (kind, help, label names, bounds), shipped with every
        delta so the receiving process can make the series and refuse a changed one."""
        return [self.kind, self.help, list(self.labels), list(self.bounds())]

    def bounds(self) -> tuple[float, ...]:
        """A histogram's bucket upper bounds (without +Inf); () for other kinds."""
        if self.kind != "histogram":
            return ()
        return tuple(self.buckets) if self.buckets is not None else LATENCY_BUCKETS_S


def series_names(family: str, kind: str) -> set[str]:
    """The sample names Prometheus shows for a family `family` of `kind`."""
    if kind == "counter":
        return {family, f"{family}_total", f"{family}_created"}
    if kind == "histogram":
        return {family, *(f"{family}_{s}" for s in ("bucket", "sum", "count", "created"))}
    return {family}


def _builtin_names() -> dict[str, str]:
    out = {}
    for name, spec in METRICS.items():
        for sample in series_names(PREFIX + name, spec.kind):
            out[sample] = f"kvhal's built-in {name!r}"
    return out


#: Sample name → who declared it (built-ins, then every tier metric made in this process).
_TAKEN: dict[str, str] = _builtin_names()
#: Family name → (tier type, spec) of every tier metric declared in this process.
_DECLARED: dict[str, tuple[str, MetricSpec]] = {}
_DECLARE_LOCK = threading.Lock()


def check_specs(tier: str, specs: Sequence[MetricSpec]) -> None:
    """Refuse bad declarations of tier type `tier`, and claim their series process-wide
    (a second tier instance of the same type and declarations claims nothing new).

    Raises:
        MetricDeclarationError: the tier's name or a metric's name, kind, help, labels or
            buckets is invalid, two of its metrics share a name, or a series clashes with a
            built-in figure or another tier type's metric; the message names tier and metric.
    """
    if not isinstance(tier, str) or not _NAME.fullmatch(tier):
        raise MetricDeclarationError(f"tier {tier!r}: its name is not a valid Prometheus name "
                                     "part ([a-zA-Z_][a-zA-Z0-9_]*), so it cannot declare "
                                     "metrics")
    seen: set[str] = set()
    for spec in specs:
        if not isinstance(spec, MetricSpec):
            raise MetricDeclarationError(f"tier {tier!r}: metric_specs holds {spec!r}, not a "
                                         "kvhal.tier_metrics.MetricSpec")
        _check_one(tier, spec)
        if spec.name in seen:
            raise MetricDeclarationError(f"tier {tier!r} metric {spec.name!r}: declared twice")
        seen.add(spec.name)
    with _DECLARE_LOCK:
        claims: dict[str, str] = {}
        for spec in specs:
            family = f"{PREFIX}{tier}_{spec.name}"
            mine = _DECLARED.get(family)
            if mine is not None:
                if mine != (tier, spec):
                    raise MetricDeclarationError(
                        f"tier {tier!r} metric {spec.name!r}: {family} is already declared "
                        f"by tier {mine[0]!r} as {mine[1]!r}")
                continue
            owner = f"tier {tier!r} metric {spec.name!r}"
            for sample in series_names(family, spec.kind):
                other = _TAKEN.get(sample) or claims.get(sample)
                if other is not None:
                    raise MetricDeclarationError(f"{owner}: series {sample} clashes with "
                                                 f"{other}")
                claims[sample] = owner
        _TAKEN.update(claims)
        for spec in specs:
            _DECLARED.setdefault(f"{PREFIX}{tier}_{spec.name}", (tier, spec))


def _check_one(tier: str, spec: MetricSpec) -> None:
    where = f"tier {tier!r} metric {spec.name!r}"
    if not isinstance(spec.name, str) or not _NAME.fullmatch(spec.name):
        raise MetricDeclarationError(f"{where}: not a valid Prometheus name "
                                     "([a-zA-Z_][a-zA-Z0-9_]*)")
    if spec.kind not in KINDS:
        raise MetricDeclarationError(f"{where}: kind {spec.kind!r} is none of {KINDS}")
    if spec.kind == "counter" and spec.name.endswith(("_total", "_created")):
        raise MetricDeclarationError(f"{where}: a counter's name ends without '_total' "
                                     "(Prometheus adds it)")
    if not isinstance(spec.help, str) or not spec.help.strip():
        raise MetricDeclarationError(f"{where}: help must be a non-empty str")
    if not isinstance(spec.labels, Mapping):
        raise MetricDeclarationError(f"{where}: labels must map label name → allowed values "
                                     f"or a max count, got {type(spec.labels).__name__}")
    for label, bound in spec.labels.items():
        if not isinstance(label, str) or not _NAME.fullmatch(label) or label.startswith("__") \
                or label in RESERVED_LABELS:
            raise MetricDeclarationError(f"{where}: label {label!r} is not a valid label name "
                                         f"or is reserved ({', '.join(sorted(RESERVED_LABELS))})")
        if bound is None:
            raise MetricDeclarationError(
                f"{where}: label {label!r} has no bound: give its allowed values (a tuple of "
                "str) or the most distinct values it takes (an int ≥ 1)")
        if isinstance(bound, bool) or not isinstance(bound, (int, tuple)):
            raise MetricDeclarationError(
                f"{where}: label {label!r} bound must be a tuple of str (its allowed values) "
                f"or an int (the most distinct values it takes), got {type(bound).__name__}")
        if isinstance(bound, int) and bound < 1:
            raise MetricDeclarationError(f"{where}: label {label!r} max must be ≥ 1, got "
                                         f"{bound}")
        if isinstance(bound, tuple) and (not bound or len(set(bound)) != len(bound) or
                                         not all(isinstance(v, str) and v for v in bound)):
            raise MetricDeclarationError(f"{where}: label {label!r} allowed values must be "
                                         f"distinct non-empty str, got {bound!r}")
    if spec.kind == "histogram":
        bounds = spec.bounds()
        if not bounds or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and
                                 math.isfinite(b) for b in bounds) or list(bounds) != sorted(set(bounds)):
            raise MetricDeclarationError(f"{where}: buckets must be finite and strictly "
                                         f"increasing, got {spec.buckets!r}")
    elif spec.buckets is not None:
        raise MetricDeclarationError(f"{where}: buckets are for histograms, not a {spec.kind}")


class _Child:
    """One labelled series of one tier instance: its value (counter, gauge) or bucket counts
    + sum + count (histogram), and the samples not yet shipped. Updates take `lock` once and
    refuse what the metric's kind has not (a kept series is the hot path: it checks too).

    Raises (from updates): ValueError naming tier and metric."""

    __slots__ = ("buckets", "fn", "hist", "keep", "kind", "lock", "samples", "value", "where")

    def __init__(self, where: str, kind: str, buckets: tuple[float, ...], keep: list[bool]):
        self.lock = threading.Lock()
        self.where = where    # "tier 'x' metric 'y'", for errors
        self.kind = kind
        self.value = 0.0
        self.buckets = buckets
        self.hist = [0.0] * (len(buckets) + 3) if buckets else None  # buckets, +Inf, sum, count
        self.samples: list[float] = []
        self.keep = keep      # shared one-item list: whether samples are kept for take_delta
        self.fn: Callable[[], float] | None = None     # a gauge read when exported

    def read(self) -> float:
        """A counter's or gauge's value now (a gauge's `set_function` called)."""
        fn = self.fn
        if fn is not None:
            return fn()
        with self.lock:
            return self.value

    def inc(self, amount: float = 1.0) -> None:
        """Add `amount`, a number (a counter's: ≥ 0 and not NaN; a histogram has no `inc`)."""
        try:
            if self.kind == "gauge" or self.kind == "counter" and amount >= 0:
                with self.lock:
                    self.value += amount
                return
        except TypeError:
            pass
        raise ValueError(f"{self.where}: inc({amount!r}) on a {self.kind}")

    def set(self, value: float) -> None:
        """Set a gauge to `value` (a number)."""
        if self.kind != "gauge":
            raise ValueError(f"{self.where}: set on a {self.kind}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{self.where}: set({value!r}): not a number") from None
        with self.lock:
            self.value = number

    def observe(self, value: float) -> None:
        """Record one sample of a histogram (a number, not NaN)."""
        h = self.hist
        if h is None:
            raise ValueError(f"{self.where}: observe on a {self.kind}")
        try:
            i = bisect.bisect_left(self.buckets, value)
        except TypeError:
            i = -1
        if i < 0 or math.isnan(value):
            raise ValueError(f"{self.where}: observe({value!r}): not a number")
        with self.lock:
            h[i] += 1
            h[-2] += value
            h[-1] += 1
            if self.keep[0]:
                self.samples.append(value)


class Metric:
    """A declared metric of one tier instance: `labels(...)` picks a labelled series (keep it
    for a hot path); `inc` / `set` / `dec` / `observe` update the unlabelled one (a metric
    without labels) or, with label keywords, the one they name.

    Raises (from updates): ValueError for a label value outside the declared ones, a missing
    or unknown label, a negative counter increment, or an update its kind has not (a counter
    has no `set`)."""

    def __init__(self, owner: TierMetrics, spec: MetricSpec):
        self.spec = spec
        self._owner = owner
        self._names = tuple(spec.labels)
        self._children: dict[tuple[str, ...], _Child] = {}  # as asked for → its series
        self._series: dict[tuple[str, ...], _Child] = {}    # label values (folded) → series
        self._seen = {n: set() for n, b in spec.labels.items() if not isinstance(b, tuple)}
        self._make_lock = threading.Lock()
        self._warned = False
        self._where = f"tier {owner.tier!r} metric {spec.name!r}"

    def labels(self, *values: str, **by_name: str) -> _Child:
        """The series of these label values (positional in declared order, or by name; not
        both)."""
        if by_name:
            if values or len(by_name) != len(self._names):
                raise ValueError(f"{self._where}: labels are {list(self._names)}, got "
                                 f"{[*values, *by_name]}")
            values = tuple([by_name.get(n, _MISSING) for n in self._names])
        child = self._children.get(values)
        if child is None:
            child = self._make(values, by_name)
        return child

    def _make(self, key: tuple, by_name: Mapping[str, str]) -> _Child:
        where = self._where
        if by_name and set(by_name) != set(self._names) or len(key) != len(self._names):
            raise ValueError(f"{where}: labels are {list(self._names)}, got "
                             f"{[*key, *by_name]}")
        with self._make_lock:
            child = self._children.get(key)
            if child is not None:
                return child
            folded = []
            for name, value in zip(self._names, key):
                bound, seen = self.spec.labels[name], self._seen.get(name)
                if seen is None:
                    if value not in bound:
                        raise ValueError(f"{where}: label {name!r} value {value!r} is not "
                                         f"one of {bound}")
                elif (value := str(value)) != OTHER and value not in seen:
                    if len(seen) >= bound:
                        if not self._warned:
                            log.warning("%s: label %r has reached its max of %d values; "
                                        "later values are counted as %r", where, name,
                                        bound, OTHER)
                            self._warned = True
                        value = OTHER
                    else:
                        seen.add(value)
                folded.append(value)
            child = self._series.get(tuple(folded))
            if child is None:
                child = _Child(where, self.spec.kind, self.spec.bounds(),
                               self._owner.keep_samples)
                self._series[tuple(folded)] = child
            if OTHER not in folded or OTHER in key:   # an over-the-max value is not kept
                self._children[key] = child
            return child

    def _default(self, by_name: Mapping[str, str]) -> _Child:
        if by_name or self._names:
            return self.labels(**by_name)
        child = self._children.get(())
        return child if child is not None else self._make((), {})

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        """Add `amount` (counter: ≥ 0; gauge: any)."""
        self._default(labels).inc(amount)

    def dec(self, amount: float = 1.0, **labels: str) -> None:
        """Subtract `amount` from a gauge."""
        self._gauge_only("dec")
        self._default(labels).inc(-amount)

    def set(self, value: float, **labels: str) -> None:
        """Set a gauge."""
        self._default(labels).set(value)

    def observe(self, value: float, **labels: str) -> None:
        """Record one sample of a histogram (in its unit, e.g. seconds)."""
        self._default(labels).observe(value)

    def set_function(self, fn: Callable[[], float], **labels: str) -> None:
        """Make a gauge read `fn()` whenever it is exported (a figure the tier already keeps,
        e.g. peers connected now: nothing to update on the hot path). `fn` runs on the scrape
        or the engine's thread: it must be quick and thread-safe. An exception from `fn`
        exports NaN (one warning naming tier, metric and the exception's type; not its
        message, which may carry an address or a key)."""
        self._gauge_only("set_function")
        warned = []

        def read() -> float:
            try:
                return float(fn())
            except Exception as exc:  # noqa: BLE001 - a tier's bug must not fail a scrape or a step
                if not warned:
                    warned.append(True)
                    log.warning("%s: its gauge function raised %s; exported as NaN",
                                self._where, type(exc).__name__)
                return math.nan
        self._default(labels).fn = read

    def _gauge_only(self, verb: str) -> None:
        if self.spec.kind != "gauge":
            raise ValueError(f"tier {self._owner.tier!r} metric {self.spec.name!r}: {verb} "
                             f"on a {self.spec.kind}")

    def series(self) -> dict[tuple[str, ...], _Child]:
        """Each series by its label values (values beyond a label's max folded to `OTHER`)."""
        with self._make_lock:
            return dict(self._series)


class TierMetrics:
    """The declared metrics of one tier instance, by name (`metrics["retries"]`).

    Args:
        tier: The tier's type name (`SecondaryTier.name`): the series are `kvhal_<tier>_*`.
        specs: Its declarations (`SecondaryTier.metric_specs`).

    Attributes:
        label: The instance's `tier` label ("fs", "fs-2"; the engine sets it, default `tier`).

    Raises:
        MetricDeclarationError: from `check_specs`.
    """

    def __init__(self, tier: str, specs: Sequence[MetricSpec]):
        check_specs(tier, specs)
        self.tier = tier
        self.label = tier
        self.keep_samples = [False]
        self._metrics = {s.name: Metric(self, s) for s in specs}
        self._taken: dict[tuple[str, tuple[str, ...]], float] = {}
        if self._metrics:
            _TIERS.add(self)

    def __getitem__(self, name: str) -> Metric:
        try:
            return self._metrics[name]
        except KeyError:
            raise KeyError(f"tier {self.tier!r} declares no metric {name!r}; declared: "
                           f"{', '.join(self._metrics) or 'none'}") from None

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._metrics.values())

    def snapshot(self) -> dict[str, dict[tuple[str, ...], list[float]]]:
        """Cumulative figures: name → {label values: [value]} (histogram: bucket counts,
        +Inf count, sum, count)."""
        out: dict[str, dict[tuple[str, ...], list[float]]] = {}
        for metric in self._metrics.values():
            for key, child in metric.series().items():
                if child.hist is not None:
                    with child.lock:
                        figures = list(child.hist)
                else:
                    figures = [child.read()]
                out.setdefault(metric.spec.name, {})[key] = figures
        return out

    def take_delta(self) -> list[dict[str, Any]]:
        """What changed since the last call, as plain data: one block per metric that has
        figures, `{"family": "<tier>_<name>", "decl": MetricSpec.wire(), "values": [[[tier
        label, *label values], figure], ...]}`, figure = counter increment, gauge value (every
        gauge, every call), or list of histogram samples (kept only once `keep_samples[0]` is
        set). Unchanged counters and histograms are left out."""
        out: list[dict[str, Any]] = []
        for metric in self._metrics.values():
            spec, values = metric.spec, []
            for key, child in metric.series().items():
                with child.lock:
                    samples = child.samples
                    child.samples = []
                value = child.read() if child.hist is None else 0.0
                if spec.kind == "gauge":
                    values.append([[self.label, *key], value])
                elif spec.kind == "histogram":
                    if samples:
                        values.append([[self.label, *key], samples])
                else:
                    last = self._taken.get((spec.name, key), 0.0)
                    if value > last:
                        values.append([[self.label, *key], value - last])
                        self._taken[(spec.name, key)] = value
            if values:
                out.append({"family": f"{self.tier}_{spec.name}", "decl": spec.wire(),
                            "values": values})
        return out


_TIERS: weakref.WeakSet[TierMetrics] = weakref.WeakSet()


class _Collector:
    """Sums every live tier instance's figures into `kvhal_<tier>_<name>` series at scrape
    time (instances of one `tier` label add up)."""

    def collect(self) -> Iterator:
        sums: dict[tuple[str, str], dict[tuple[str, ...], list[float]]] = {}
        specs: dict[tuple[str, str], MetricSpec] = {}
        for tier in list(_TIERS):
            for name, by_key in tier.snapshot().items():
                specs[(tier.tier, name)] = tier[name].spec
                acc = sums.setdefault((tier.tier, name), {})
                for key, figures in by_key.items():
                    mine = acc.setdefault((tier.label, *key), [0.0] * len(figures))
                    for i, v in enumerate(figures):
                        mine[i] += v
        for family_key, spec in sorted(specs.items()):
            name = f"{PREFIX}{family_key[0]}_{spec.name}"
            labels = ["tier", *spec.labels]
            if spec.kind == "counter":
                family = CounterMetricFamily(name, spec.help, labels=labels)
            elif spec.kind == "gauge":
                family = GaugeMetricFamily(name, spec.help, labels=labels)
            else:
                family = HistogramMetricFamily(name, spec.help, labels=labels)
            for key, figures in sorted(sums[family_key].items()):
                if spec.kind != "histogram":
                    family.add_metric(list(key), figures[0])
                    continue
                cumulative, buckets = 0.0, []
                for bound, c in zip((*spec.bounds(), math.inf), figures):
                    cumulative += c
                    buckets.append(("+Inf" if bound == math.inf else repr(float(bound)),
                                    cumulative))
                family.add_metric(list(key), buckets, figures[-2])
            yield family


REGISTRY.register(_Collector())
