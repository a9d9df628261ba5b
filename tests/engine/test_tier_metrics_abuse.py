"""A tier's own metrics under misuse: updates its kind has not, made through a kept series
(`labels(...)`, the hot path README recommends); unknown label names; a gauge function that
raises; label values (peer addresses, tokens) kept out of kvhal's logs."""
from __future__ import annotations

import logging
import math

import pytest
from kvhal.tiers.memory import MemoryTier
from prometheus_client import REGISTRY, generate_latest

from kvhal.config import ConfigError
from kvhal.tier_metrics import MetricDeclarationError, MetricSpec, TierMetrics

from .rig import make_rig


def _metrics(tier: str) -> TierMetrics:
    return TierMetrics(tier, (
        MetricSpec("ops", "counter", "Ops by outcome", labels={"outcome": ("ok", "error")}),
        MetricSpec("seconds", "histogram", "Op time, seconds", buckets=(0.1, 1.0)),
        MetricSpec("open", "gauge", "Open connections"),
        MetricSpec("pulls", "counter", "Pulls by peer", labels={"peer": 2}),
    ))


@pytest.mark.parametrize("update, match", [
    (lambda m: m["ops"].labels(outcome="ok").inc(-1), r"inc\(-1\) on a counter"),
    (lambda m: m["ops"].labels("ok").inc(math.nan), r"inc\(nan\) on a counter"),
    (lambda m: m["ops"].inc(math.nan, outcome="ok"), r"inc\(nan\) on a counter"),
    (lambda m: m["ops"].labels("ok").set(5), "set on a counter"),
    (lambda m: m["ops"].labels("ok").observe(0.5), "observe on a counter"),
    (lambda m: m["seconds"].labels().inc(), r"inc\(1.0\) on a histogram"),
    (lambda m: m["seconds"].labels().set(1), "set on a histogram"),
    (lambda m: m["seconds"].observe(math.nan), r"observe\(nan\)"),
    (lambda m: m["seconds"].observe("0.5"), r"observe\('0.5'\)"),
    (lambda m: m["open"].labels().observe(1), "observe on a gauge"),
    (lambda m: m["ops"].labels("ok").inc("1"), r"inc\('1'\) on a counter"),
    (lambda m: m["open"].inc("1"), r"inc\('1'\) on a gauge"),
])
def test_a_kept_series_refuses_updates_its_kind_has_not(update, match):
    metrics = _metrics("abused_kind")
    with pytest.raises(ValueError, match=f"tier 'abused_kind' metric '.*': {match}"):
        update(metrics)
    snapshot = metrics.snapshot()
    assert all(v == [0.0] for v in snapshot.get("ops", {}).values()), snapshot
    assert all(not math.isnan(x) and x == 0 for v in snapshot.get("seconds", {}).values()
               for x in v), snapshot


@pytest.mark.parametrize("call", [
    lambda m: m["ops"].labels(outcome="ok", bogus="x"),
    lambda m: m["ops"].labels("ok", outcome="error"),
    lambda m: m["pulls"].labels(peer_id="a"),
])
def test_unknown_or_mixed_label_names_are_refused_once_the_series_is_kept(call):
    metrics = _metrics("abused_labels")
    metrics["ops"].labels(outcome="ok")             # kept: later lookups skip the checks
    metrics["pulls"].labels(peer="a")
    with pytest.raises(ValueError, match="tier 'abused_labels' metric '.*': labels are"):
        call(metrics)


def test_a_gauge_function_that_raises_breaks_neither_the_scrape_nor_the_deltas(caplog):
    metrics = _metrics("abused_gauge")
    metrics["ops"].labels("ok").inc()

    def broken() -> float:
        raise RuntimeError("s3://AKIASECRET:hunter2@bucket unreachable")
    metrics["open"].set_function(broken)
    with caplog.at_level(logging.WARNING, logger="kvhal.tier_metrics"):
        for _ in range(3):
            text = generate_latest(REGISTRY).decode()
            blocks = metrics.take_delta()
    assert 'kvhal_abused_gauge_ops_total{outcome="ok",tier="abused_gauge"} 1.0' in text
    assert 'kvhal_abused_gauge_open{tier="abused_gauge"} NaN' in text
    assert math.isnan(next(b["values"] for b in blocks if b["family"] == "abused_gauge_open")[0][1])
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "abused_gauge" in warned[0] and "RuntimeError" in warned[0]
    assert "hunter2" not in caplog.text


def test_the_max_warning_names_no_label_value(caplog):
    metrics = _metrics("abused_max")
    with caplog.at_level(logging.WARNING, logger="kvhal.tier_metrics"):
        for token in ("tok-a", "tok-b", "tok-SECRET", "tok-SECRET2"):
            metrics["pulls"].labels(peer=token).inc()
    assert "abused_max" in caplog.text and "max of 2" in caplog.text
    assert "SECRET" not in caplog.text


class FaultyMetricsTier(MemoryTier):
    """A fake: a tier whose `metrics` property has a bug (an attribute it never set)."""

    name = "faulty_metrics_mem"

    @property
    def metrics(self):
        """Raises AttributeError, as a typo in a tier's own property would."""
        return self._never_set


def test_a_tier_whose_metrics_raise_attribute_error_is_refused_at_start():
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\].*'faulty_metrics_mem' tier "
                                          r"failed: AttributeError"):
        make_rig(tiers=[{"type": "faulty_metrics_mem",
                         "module_path": f"{__name__}:FaultyMetricsTier"}])


@pytest.mark.parametrize("spec, match", [
    (MetricSpec("x", "counter", "x", labels={"op": ["get", "put"]}),
     r"label 'op' bound must be a tuple of str .* or an int .*, got list"),
    (MetricSpec("x", "histogram", "x", buckets=(True, 2.0)), "buckets must be"),
], ids=["list of values", "bool bucket"])
def test_declarations_a_tier_author_gets_wrong_are_named_as_such(spec, match):
    with pytest.raises(MetricDeclarationError, match=f"tier 'abused_decl' metric 'x': {match}"):
        TierMetrics("abused_decl", (spec,))


def test_other_and_a_values_spellings_take_no_extra_place_under_a_max():
    metrics = _metrics("abused_other")
    for peer in ("other", 7, "7", "b", "c"):
        metrics["pulls"].labels(peer=peer).inc()
    assert {k: c.value for k, c in metrics["pulls"].series().items()} == {
        ("other",): 2, ("7",): 2, ("b",): 1}


@pytest.mark.parametrize("value", ["3 peers", None, [1]], ids=repr)
def test_a_gauge_set_to_a_non_number_is_refused_and_the_scrape_survives(value):
    metrics = _metrics(f"abused_set_{type(value).__name__}")
    metrics["open"].set(2)
    with pytest.raises(ValueError, match=r"metric 'open': set\(.*\): not a number"):
        metrics["open"].set(value)
    text = generate_latest(REGISTRY).decode()
    assert f'kvhal_abused_set_{type(value).__name__}_open{{tier=' in text
    assert metrics.take_delta()[0]["values"][0][1] == 2
