"""The soak's report a person reads: what each fault cost, hit tokens by
source over time (scraped from each server's `/metrics`), the events' truth, as tables and a
timeline.

A fault's *window* runs from its start to `AFTER_S` after its end; its requests are those in
flight at its start or sent inside the window. What it cost, per kind, over its requests:
retries (`tries - 1`), failed requests, misses (a request that hit fewer prompt tokens than it
could reuse: `cached_tokens < reusable_tokens`), recompute tokens (`reusable - cached` summed,
the prompt tokens computed again that kvhal could have served) and latency (p99 and max of
`done_s - sent_s`). The baseline row is the requests outside every window, so a kind's numbers
read against what the same load costs without faults. Windows overlap when faults come closer
than `AFTER_S` plus their length: a kind's "alone" figures take only the requests no other
kind's window holds, what that kind cost by itself.
"""
from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Mapping, Sequence

import numpy as np

from ..vllm.serve_metrics import SOURCES, cached_by_source, parse

#: Seconds after a fault's end its window runs on (restarted servers warm up, tiers re-list).
AFTER_S = 20.0
#: Seconds between two scrapes of every server's `/metrics`.
SAMPLE_S = 2.0
#: Width of the timeline's rate bins (seconds).
BIN_S = 10.0


def _latency(requests: Sequence[Mapping]) -> tuple[float, float]:
    lat = [r["done_s"] - r["sent_s"] for r in requests if r["verdict"] != "failed"]
    if not lat:
        return 0.0, 0.0
    return float(np.percentile(lat, 99)), float(max(lat))


def _costs(requests: Sequence[Mapping]) -> dict:
    p99, worst = _latency(requests)
    misses = [r for r in requests if r["cached_tokens"] < r["reusable_tokens"]]
    return {"requests": len(requests),
            "retries": sum(r["tries"] - 1 for r in requests if r["tries"]),
            "failed": sum(r["verdict"] == "failed" for r in requests),
            "misses": len(misses),
            "recompute_tokens": sum(max(0, r["reusable_tokens"] - r["cached_tokens"])
                                    for r in requests),
            "p99_s": round(p99, 2), "max_s": round(worst, 2)}


def in_window(request: Mapping, fault: Mapping, after_s: float = AFTER_S) -> bool:
    """Whether `request` (times `sent_s`, `done_s`) belongs to `fault`'s window (`start_s`,
    `end_s`): in flight at its start, or sent between its start and `after_s` past its end."""
    start, stop = fault["start_s"], fault["end_s"] + after_s
    return (request["sent_s"] <= start <= request["done_s"]) or start <= request["sent_s"] <= stop


def fault_costs(requests: Sequence[Mapping], faults: Sequence[Mapping],
                after_s: float = AFTER_S) -> dict:
    """What each fault kind cost (module docstring).

    Args:
        requests: `Request.to_json()` dicts (`sent_s`, `done_s`, `tries`, `verdict`,
            `cached_tokens`, `reusable_tokens`).
        faults: The faults applied (`kind`, `start_s`, `end_s`).
        after_s: Seconds a window runs past its fault's end.

    Returns:
        {"baseline": costs of the requests outside every window, "by_kind": {kind: costs of
        its windows' requests (each request once per kind) plus "count" (faults) and "alone"
        (the costs of those of its requests in no other kind's window)}, "each": [per fault:
        kind, start_s, end_s and its window's costs]}.
    """
    by_kind: dict[str, dict] = {}
    for kind in sorted({f["kind"] for f in faults}):
        mine = [f for f in faults if f["kind"] == kind]
        others = [f for f in faults if f["kind"] != kind]
        hit = [r for r in requests if any(in_window(r, f, after_s) for f in mine)]
        alone = [r for r in hit if not any(in_window(r, f, after_s) for f in others)]
        by_kind[kind] = {"count": len(mine)} | _costs(hit) | {"alone": _costs(alone)}
    calm = [r for r in requests if not any(in_window(r, f, after_s) for f in faults)]
    each = [{"kind": f["kind"], "start_s": f["start_s"], "end_s": f["end_s"]}
            | _costs([r for r in requests if in_window(r, f, after_s)]) for f in faults]
    return {"window_after_s": after_s, "baseline": _costs(calm), "by_kind": by_kind,
            "each": each}


def fault_rows(costs: Mapping) -> list[list]:
    """Table rows of `fault_costs`: the baseline, then each kind."""
    rows = []
    for name, c in [("(no fault: baseline)", costs["baseline"] | {"count": "-"}),
                    *sorted(costs["by_kind"].items())]:
        alone = c.get("alone")
        rows.append([name, c["count"], c["requests"], c["retries"], c["failed"], c["misses"],
                     c["recompute_tokens"], f"{c['p99_s']:.1f}", f"{c['max_s']:.1f}",
                     "-" if alone is None else f"{alone['requests']} / {alone['misses']} / "
                     f"{alone['recompute_tokens']} / {alone['max_s']:.1f}"])
    return rows


FAULT_COLUMNS = ["fault", "count", "requests", "retries", "failed", "misses",
                 "recompute tokens", "p99 s", "max s",
                 "alone: requests / misses / recompute / max s"]


def event_rows(events: Mapping) -> list[list]:
    """Table rows of `events.ClaimLedger.report` (+ feeds): one per checked tier."""
    rows = []
    for tier, t in events.get("tiers", {}).items():
        bad, never = t["became_unloadable"], t["never_retracted"]
        rows.append([tier, t["claims"], t["retracted"],
                     f"{bad['missing']} / {bad['damaged']} / {bad['unreachable']}",
                     f"{t['max_stale_lo_s']:.1f}..{t['max_stale_s']:.1f}",
                     f"{never['missing']} / {never['damaged']} / {never['unreachable']}",
                     f"{t['max_never_retracted_s']:.1f}",
                     events.get("bounds_s", {}).get(tier, "-"), t["violations"],
                     t["past_bound_while_stopped"]])
    return rows


EVENT_COLUMNS = ["tier", "claims", "retracted", "unloadable missing/damaged/unreachable",
                 "max stale s (lo..hi)", "never retracted missing/damaged/unreachable",
                 "oldest never retracted s", "bound s", "violations",
                 "past bound, server stopped"]


class HitSampler(threading.Thread):
    """Scrapes each server's `vllm:prompt_tokens_cached_by_source` every `SAMPLE_S` seconds;
    `series` holds (seconds after `t0`, server index, cumulative tokens per source across
    the server's restarts). A new process (the server's `starts` changed, or a counter lower
    than at the last scrape) counts from 0; tokens served between the last scrape and a kill
    are lost to the timeline (not to the run's totals, scraped before each kill).

    Args:
        servers: The servers (`url`, `starts`: `fleet.Server`).
        t0: `time.monotonic()` the times count from.
    """

    def __init__(self, servers: Sequence, t0: float):
        super().__init__(name="soak-hits", daemon=True)
        self.servers, self.t0 = servers, t0
        self.series: list[tuple[float, int, dict[str, int]]] = []
        self._last: list[dict[str, int]] = [{} for _ in servers]
        self._starts: list[int | None] = [None for _ in servers]
        self._base: list[dict[str, int]] = [dict.fromkeys(SOURCES, 0) for _ in servers]
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(SAMPLE_S):
            self.sample()

    def sample(self) -> None:
        """Scrape every server once (a server that does not answer is skipped)."""
        for i, server in enumerate(self.servers):
            starts = server.starts
            try:
                with urllib.request.urlopen(f"{server.url}/metrics", timeout=5) as r:
                    raw = cached_by_source(parse(r.read().decode()))
            except (OSError, ValueError):
                continue
            self.add(i, raw, time.monotonic() - self.t0, starts)

    def add(self, i: int, raw: Mapping[str, int], at_s: float, starts: int | None = None
            ) -> None:
        """Record server `i`'s scraped counters `raw` (source → tokens) at `at_s`, scraped
        from its process number `starts` (None: unknown)."""
        last = self._last[i]
        restarted = starts is not None and self._starts[i] not in (None, starts)
        if restarted or any(raw.get(s, 0) < last.get(s, 0) for s in SOURCES):
            self._base[i] = {s: self._base[i][s] + last.get(s, 0) for s in SOURCES}
        self._last[i], self._starts[i] = dict(raw), starts
        self.series.append((round(at_s, 2), i, {s: self._base[i][s] + raw.get(s, 0)
                                                 for s in SOURCES}))


def hit_rates(series: Sequence[tuple[float, int, Mapping[str, int]]], end_s: float,
              bin_s: float = BIN_S) -> tuple[list[float], dict[str, list[float]]]:
    """Hit tokens per second by source in bins of `bin_s` (all servers summed), from a
    `HitSampler.series`: (bin starts, {source: tokens/s per bin}); sources that served
    nothing are left out."""
    edges = np.arange(0.0, end_s + bin_s, bin_s)
    rates = {s: np.zeros(len(edges)) for s in SOURCES}
    prev: dict[int, Mapping[str, int]] = {}
    for t, i, totals in series:
        b = min(int(t // bin_s), len(edges) - 1)
        before = prev.get(i, dict.fromkeys(SOURCES, 0))
        for s in SOURCES:
            rates[s][b] += (totals[s] - before.get(s, 0)) / bin_s
        prev[i] = totals
    return ([float(e) for e in edges],
            {s: [float(v) for v in r] for s, r in rates.items() if r.any()})
