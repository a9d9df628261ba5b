"""`kvhal soak`'s report (`integrations/harness/soak/report.py`): what each fault cost, hit
tokens by source over time, and the timeline PNG, from recorded requests and scrapes."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from kvhal.integrations.harness.soak.report import (
    HitSampler,
    fault_costs,
    fault_rows,
    hit_rates,
    in_window,
)


def _req(sent, done, cached=100, reusable=100, tries=1, verdict="ok"):
    return {"sent_s": sent, "done_s": done, "cached_tokens": cached, "reusable_tokens": reusable,
            "tries": tries, "verdict": verdict}


FAULTS = [{"kind": "kill_restart", "start_s": 100.0, "end_s": 101.0},
          {"kind": "s3_restart", "start_s": 200.0, "end_s": 203.0}]


def test_a_window_holds_requests_in_flight_at_the_start_and_those_sent_until_after_s():
    f = FAULTS[0]
    assert in_window(_req(99.0, 100.5), f)            # in flight at the start
    assert in_window(_req(120.9, 130.0), f, 20.0)      # sent before end + 20
    assert not in_window(_req(121.5, 122.0), f, 20.0)
    assert not in_window(_req(90.0, 99.0), f)


def test_each_fault_kind_costs_its_windows_requests_against_the_baseline():
    """Fails when misses, recompute tokens, retries or latency are taken over the wrong
    requests (the baseline included in a fault's, or a window's requests left out)."""
    requests = [_req(10.0, 11.0), _req(20.0, 21.0, cached=0, reusable=256),   # baseline
                _req(99.5, 130.0, tries=2, cached=0, reusable=512),            # kill: retried
                _req(105.0, 106.0, cached=128, reusable=384),                  # kill: a miss
                _req(201.0, 201.5, verdict="failed", cached=0, reusable=0),    # s3
                _req(210.0, 212.0, cached=512, reusable=512)]                  # s3, full hit
    costs = fault_costs(requests, FAULTS, after_s=20.0)
    base, kill, s3 = costs["baseline"], costs["by_kind"]["kill_restart"], \
        costs["by_kind"]["s3_restart"]
    assert base == {"requests": 2, "retries": 0, "failed": 0, "misses": 1,
                    "recompute_tokens": 256, "p99_s": pytest.approx(1.0), "max_s": 1.0}
    assert kill["count"] == 1 and kill["requests"] == 2 and kill["retries"] == 1
    assert kill["misses"] == 2 and kill["recompute_tokens"] == 512 + 256
    assert kill["max_s"] == 30.5 and kill["p99_s"] == pytest.approx(30.5 - 0.01 * 29.5, 0.01)
    assert s3["requests"] == 2 and s3["failed"] == 1 and s3["misses"] == 0
    assert s3["max_s"] == 2.0               # a failed request has no latency
    assert [(e["kind"], e["requests"], e["max_s"]) for e in costs["each"]] == [
        ("kill_restart", 2, 30.5), ("s3_restart", 2, 2.0)]
    rows = fault_rows(costs)
    assert [r[0] for r in rows] == ["(no fault: baseline)", "kill_restart", "s3_restart"]


def test_a_request_in_two_kinds_windows_counts_for_each_but_alone_for_neither():
    """Fails when "alone" keeps a request another kind's window also holds."""
    faults = [{"kind": "kill_restart", "start_s": 100.0, "end_s": 101.0},
              {"kind": "s3_restart", "start_s": 110.0, "end_s": 112.0}]
    requests = [_req(105.0, 106.0, cached=0, reusable=256),     # kill only
                _req(111.0, 125.0, cached=0, reusable=512),     # both windows
                _req(125.0, 126.0)]                             # s3 only
    costs = fault_costs(requests, faults, after_s=20.0)
    kill, s3 = costs["by_kind"]["kill_restart"], costs["by_kind"]["s3_restart"]
    assert (kill["requests"], kill["recompute_tokens"]) == (2, 256 + 512)
    assert (kill["alone"]["requests"], kill["alone"]["recompute_tokens"]) == (1, 256)
    assert (s3["requests"], s3["recompute_tokens"]) == (2, 512)
    assert (s3["alone"]["requests"], s3["alone"]["recompute_tokens"]) == (1, 0)
    assert fault_rows(costs)[1][-1] == "1 / 1 / 256 / 1.0"


def test_hit_counters_continue_across_a_server_restart():
    """Fails when a restarted server's counters (from 0) are taken as they are."""
    sampler = HitSampler([SimpleNamespace(url="http://127.0.0.1:1", starts=1)], 0.0)
    sampler.add(0, {"device": 100, "host": 50}, 2.0, 1)
    sampler.add(0, {"device": 150, "host": 80}, 4.0, 1)
    sampler.add(0, {"device": 10, "host": 0}, 6.0, 2)       # a new process
    sampler.add(0, {"device": 30, "host": 5}, 8.0, 2)
    sampler.add(0, {"device": 200, "host": 90}, 10.0, 3)    # one that already served more
    assert [s[2]["device"] for s in sampler.series] == [100, 150, 160, 180, 380]
    assert [s[2]["host"] for s in sampler.series] == [50, 80, 80, 85, 175]
    sampler.sample()                                       # nobody listens there: skipped
    assert len(sampler.series) == 5


def test_hit_rates_are_per_second_per_bin_summed_over_servers():
    series = [(1.0, 0, {"device": 0, "host": 100, "disk": 0, "p2p": 0,
                        "external_unspecified": 0}),
              (5.0, 1, {"device": 0, "host": 0, "disk": 200, "p2p": 0,
                        "external_unspecified": 0}),
              (12.0, 0, {"device": 0, "host": 300, "disk": 0, "p2p": 0,
                         "external_unspecified": 0})]
    starts, rates = hit_rates(series, 20.0, bin_s=10.0)
    assert starts == [0.0, 10.0, 20.0]
    assert rates == {"host": [10.0, 20.0, 0.0], "disk": [20.0, 0.0, 0.0]}


def test_the_timeline_png_has_the_hit_sources_panel(tmp_path):
    pytest.importorskip("matplotlib")
    from kvhal.integrations.harness.plot import plot_soak_timeline
    from matplotlib.image import imread
    heights = []
    for hits in (None, ([0.0, 10.0], {"host": [1.0, 2.0], "disk": [0.0, 3.0]})):
        path = tmp_path / f"soak{len(heights)}.png"
        plot_soak_timeline(path, [1.0, 12.0], [0, 128], [512, 640], ["ok", "failed"],
                           [(5.0, 6.0, "kill_restart")], "t", hits=hits)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        heights.append(imread(path).shape[0])
    assert heights[1] > heights[0]          # the third panel
