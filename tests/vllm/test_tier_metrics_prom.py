"""The tiers' own metrics on vLLM's side (`KVHalPromMetrics`, vLLM's prometheus classes on a
fresh registry): series made from the shipped declaration, per engine, and a declaration that
another engine process changed is refused with one error, its figures dropped."""
from __future__ import annotations

import functools
import json
import logging
import subprocess
import sys
import types

import pytest

pytest.importorskip("vllm", reason="vLLM's connector metrics need the `vllm` extra")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402

from kvhal.integrations.vllm.stats import KVHalPromMetrics, KVHalStats  # noqa: E402

#: A process whose tier `versioned` declares `hits` as KIND, counts 5 and ships its payload.
ENGINE = """
import json, sys
from kvhal.tier_metrics import MetricSpec, TierMetrics
m = TierMetrics("versioned", (MetricSpec("hits", sys.argv[1], "Hits"),))
m["hits"].inc(5) if sys.argv[1] == "counter" else m["hits"].set(5)
print(json.dumps({"tier_metrics": m.take_delta()}))
"""


def _payload(kind: str) -> dict:
    out = subprocess.run([sys.executable, "-c", ENGINE, kind], capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _prom() -> tuple[KVHalPromMetrics, CollectorRegistry]:
    registry = CollectorRegistry()
    classes = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge,
                                                                          Histogram)}
    return KVHalPromMetrics(types.SimpleNamespace(kv_transfer_config=None), classes,
                            ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]}), registry


def test_engines_add_up_per_engine_label():
    prom, registry = _prom()
    payload = _payload("counter")
    prom.observe(payload, 0)
    prom.observe(payload, 1)
    prom.observe(payload, 1)
    value = functools.partial(registry.get_sample_value, "vllm:kv_offload_versioned_hits_total")
    assert (value({"model_name": "m", "engine": "0", "tier": "versioned"}),
            value({"model_name": "m", "engine": "1", "tier": "versioned"})) == (5, 10)


def test_a_kind_changed_between_processes_is_refused_with_one_error(caplog):
    prom, registry = _prom()
    prom.observe(_payload("counter"), 0)
    changed = _payload("gauge")
    with caplog.at_level(logging.ERROR, logger="kvhal.integrations.vllm.stats"):
        prom.observe(changed, 1)
        prom.observe(changed, 1)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "vllm:kv_offload_versioned_hits: engine 1 declares it ['gauge'" in errors[0]
    assert registry.get_sample_value("vllm:kv_offload_versioned_hits_total", {
        "model_name": "m", "engine": "1", "tier": "versioned"}) is None
    assert registry.get_sample_value("vllm:kv_offload_versioned_hits", {
        "model_name": "m", "engine": "1", "tier": "versioned"}) is None


def test_merged_stats_keep_each_block_and_sum_counters_for_the_log_line():
    payload = _payload("counter")
    stats = KVHalStats(data=json.loads(json.dumps(payload)))
    stats.aggregate(KVHalStats(data=payload))
    assert len(stats.data["tier_metrics"]) == 2
    assert stats.reduce()["versioned_hits[versioned]"] == 10
    assert not stats.is_empty() and KVHalStats(data={}).is_empty()


#: Blocks another kvhal version might ship (a changed block format): each is dropped with one
#: error; the API server's output loop (which calls `observe`) must not fail on them.
MALFORMED = [
    {"family": "nodecl"},
    {"decl": ["counter", "h", [], []], "values": []},
    {"family": "arity", "decl": ["counter", "h", ["op"], []], "values": [[["t"], 1]]},
    {"family": "histnum", "decl": ["histogram", "h", [], [1.0]], "values": [[["t"], 3]]},
    {"family": "novalues", "decl": ["gauge", "h", [], []]},
    "not a block",
]


def test_malformed_blocks_are_dropped_with_one_error_and_the_rest_applied(caplog):
    prom, registry = _prom()
    payload = _payload("counter")
    payload = {"tier_metrics": [*MALFORMED, *payload["tier_metrics"]],
               "counters": {"stored_chunks": {"host": 2}}}
    with caplog.at_level(logging.ERROR, logger="kvhal.integrations.vllm.stats"):
        prom.observe(payload, 0)
        prom.observe(payload, 0)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == len(MALFORMED), errors
    labels = {"model_name": "m", "engine": "0"}
    assert registry.get_sample_value("vllm:kv_offload_versioned_hits_total",
                                     {**labels, "tier": "versioned"}) == 10
    assert registry.get_sample_value("vllm:kv_offload_stored_chunks_total",
                                     {**labels, "tier": "host"}) == 4
