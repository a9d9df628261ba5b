"""`--link` of the network benches (`integrations/harness/bench/links.py`): each run happens
inside an emulated link (its figures are bounded by the link's rate), and the crossover."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvhal.integrations.harness import link as links
from kvhal.integrations.harness.bench.links import crossover

REASON = links.unavailable()


@pytest.mark.parametrize("points,best", [
    ([(1e9, 1.0), (10e9, 0.95), (25e9, 0.91), (40e9, 0.6)], 25e9),
    ([(40e9, 0.6), (10e9, 0.95), (25e9, 0.91), (1e9, 1.0)], 25e9),   # any order
    ([(1e9, 1.0), (10e9, 0.8), (25e9, 0.95)], 1e9),                  # stays: every rate below
    ([(1e9, 0.5), (10e9, 0.95)], None),
    ([(1e9, 0.9)], 1e9),
], ids=["falls-at-40g", "unordered", "dip", "never", "exactly-target"])
def test_crossover_is_the_highest_rate_kept_from_the_slowest_up(points, best):
    assert crossover(points, 0.9) == best


def _kvhal(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvhal.cli", *argv], capture_output=True,
                          text=True, timeout=300, check=False)


@pytest.mark.skipif(REASON is not None, reason=f"emulated links: {REASON}")
def test_bench_p2p_runs_inside_each_link():
    """At 200 Mbit/s (0.025 GB/s) the raw TCP loop and the p2p tier both stay under the rate
    (the 256 KB token bucket lets ≤ 7 % of 4 MiB through early); the row carries the P/D
    figures; nothing is left behind."""
    before = set(links.stale())
    done = _kvhal("bench", "p2p", "--link", "200mbit", "--count", "16", "--chunk-bytes",
                  "256KiB", "--repeats", "1", "--json")
    assert done.returncode in (0, 1), done.stderr
    out = json.loads(done.stdout)
    (row,) = out["links"]
    assert row["link"] == "200mbit" and row["rate_bps"] == 200e6
    assert 0 < row["raw_tcp_gbps"] <= 0.025 * 1.08
    assert 0 < row["p2p_gbps"] <= 0.025 * 1.08
    assert row["pd"]["tail_ms"]["pd"] > 0
    assert out["crossover_bps"] == (200e6 if row["ratio"] >= 0.9 else None)
    # the bench process has exited: a namespace it left is stale (other runs' are not)
    assert set(links.stale()) <= before


@pytest.mark.skipif(REASON is not None, reason=f"emulated links: {REASON}")
def test_a_link_with_an_rtt_is_refused_where_netem_is_missing():
    if links.rtt_unavailable() is None:
        pytest.skip("this kernel has netem")
    done = _kvhal("bench", "p2p", "--link", "1gbit,2ms", "--count", "4", "--repeats", "1")
    assert done.returncode == 1
    assert "an RTT needs the kernel's tc netem" in done.stderr


def test_a_bad_link_is_a_usage_error_naming_it():
    done = _kvhal("bench", "tier", "--tier", "obj", "--link", "fast")
    assert done.returncode == 2
    assert "not a link rate (e.g. 20mbit, 25gbit): 'fast'" in done.stderr
