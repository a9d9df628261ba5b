"""The cost model follows a real link: an obj tier behind an emulated link whose rate changes
mid-run (`integrations/harness/link.py`), the engine and the S3 server in its namespace
(`cost_link_child.py`)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvhal.integrations.harness import link as links

REASON = links.unavailable()
ROOT = Path(__file__).resolve().parents[2]
#: Recompute of the 8-chunk prefix (2048 tokens) at 4000 tokens/s: 0.51 s. Its 2 MiB load
#: takes ~0.025 s at 10 Gbit/s (the local S3 server's own pace; 20× that on a loaded machine
#: still loads) and 2.1 s at 8 Mbit/s.
COST_MODEL = {"prefill_tokens_per_s": 4000, "probe_every": 2}
FAST, SLOW = 10e9, 8e6


@pytest.mark.skipif(REASON is not None, reason=f"emulated links: {REASON}")
def test_the_decision_flips_when_the_link_slows_and_back_when_it_recovers():
    """Fast link: every request loads. Slowed to 8 Mbit/s: the first request still loads
    (and measures the slow link), every later one recomputes. Back to 10 Gbit/s: background
    probes (one per 2 skips) see it; within 12 requests the decision is load again, and
    stays so."""
    with links.EmulatedLink(FAST) as link:
        proc = link.popen([sys.executable, "-m", "tests.engine.cost_link_child",
                           json.dumps(COST_MODEL)], cwd=ROOT, stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True)
        try:
            assert json.loads(proc.stdout.readline()) == {"ready": True}

            seen = []

            def phase(name: str, n: int) -> list[str]:
                proc.stdin.write(f"{name} {n}\n")
                proc.stdin.flush()
                seen.append(json.loads(proc.stdout.readline()))
                return seen[-1]["decisions"]

            fast = phase("fast", 3)
            link.set_rate(SLOW)
            slow = phase("slow", 4)
            link.set_rate(FAST)
            recovered = phase("recovered", 14)
        finally:
            proc.kill()
            proc.wait()
    assert fast == ["load"] * 3, seen
    assert slow == ["load"] + ["recompute"] * 3, seen
    flip = recovered.index("load")
    assert 2 <= flip <= 12, seen            # at least one probe, at most six
    assert recovered[flip:] == ["load"] * (14 - flip), seen
