"""vLLM's `/metrics` as `kvhal bench serve` reads it: counters and gauges summed over engines.

Parsed with prometheus-client's text parser. `Scrape` keys are sample names, with the label
that matters appended for per-source series (`"vllm:prompt_tokens_cached_by_source_total/host"`).
Names (vLLM 0.32, `vllm/v1/metrics/loggers.py`, `v1/metrics/cache_hit_source.py`):
`vllm:prompt_tokens_cached_by_source_total{source=device|host|disk|p2p|external_unspecified}`,
`vllm:num_preemptions_total`, `vllm:num_requests_running` / `_waiting` (gauges),
`vllm:request_{queue,prefill,decode}_time_seconds_{sum,count}` (per-request phases) and
`vllm:iteration_tokens_total_{sum,count}` (tokens per engine step).
"""
from __future__ import annotations

from collections.abc import Mapping

#: vLLM's sources of cached prompt tokens (`v1/metrics/cache_hit_source.py`).
SOURCES = ("device", "host", "disk", "p2p", "external_unspecified")
CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"
#: kvhal's own count of chunks loaded, per tier label ("host", "fs", "p2p", "mooncake", "obj").
LOADED_BY_TIER = "vllm:kv_offload_loaded_chunks_total"
#: Per-source (per-tier) series whose label is kept in the key.
_LABELLED = {CACHED_BY_SOURCE: "source", LOADED_BY_TIER: "tier"}

Scrape = dict[str, float]


def parse(text: str) -> Scrape:
    """The samples of a `/metrics` page whose name starts with "vllm:", summed over every
    label except the per-source one (so over engines and models); `_created` samples are
    left out."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Scrape = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.startswith("vllm:") or s.name.endswith("_created"):
                continue
            key = s.name
            if s.name in _LABELLED:
                key = f"{s.name}/{s.labels.get(_LABELLED[s.name], '')}"
            out[key] = out.get(key, 0.0) + s.value
    return out


def delta(before: Mapping[str, float], after: Mapping[str, float]) -> Scrape:
    """`after - before` for every key of `after` (a key absent before counts from 0)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def cached_by_source(d: Mapping[str, float]) -> dict[str, int]:
    """Prompt tokens served from each source in a `delta` (every source, zeros included)."""
    return {src: int(d.get(f"{CACHED_BY_SOURCE}/{src}", 0)) for src in SOURCES}


def loaded_by_tier(d: Mapping[str, float]) -> dict[str, int]:
    """Chunks kvhal loaded from each tier in a `delta` (kvhal's own accounting: it tells the
    p2p tier from mooncake, which vLLM's sources both count as "p2p"); tiers that loaded
    nothing are left out."""
    prefix = f"{LOADED_BY_TIER}/"
    return {k[len(prefix):]: int(v) for k, v in d.items() if k.startswith(prefix) and v}


def mean(d: Mapping[str, float], name: str) -> float | None:
    """`name`'s mean over a `delta` (its `_sum` over its `_count`; None if nothing counted)."""
    count = d.get(f"{name}_count", 0.0)
    return d.get(f"{name}_sum", 0.0) / count if count else None
