"""The seeded soak CI runs: `kvhal soak` as a subprocess for `MINUTES` of load with a fault
every `GAP_S` seconds on average, so every fault kind comes once; its report's real values are
checked (not only its exit code): 0 wrong answers, 0 cross-tenant hits, nothing leaked, every
fault kind applied, a keyless p2p client got 0 bytes from each server, kvhal served at least a
tenth of the reusable prompt tokens. Still without the mooncake tier (`--no-mooncake`): the
'setup returned -1' that kept it out was the soak's own, fixed (tests/harness/test_soak_checks.py),
but no seeded run with it has passed yet on this loaded 2-core machine (nor without it: a fault
kind unapplied, too few requests); see the README's soak section."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from kvhal.integrations.harness.soak import faults as faultlib
from kvhal.integrations.harness.soak.driver import MIN_SERVED

pytest.importorskip("vllm", reason="the soak runs real vLLM servers (the `vllm` extra)")
pytestmark = pytest.mark.slow

MINUTES = 3.0
GAP_S = 7.0
#: A seed whose schedule damages objects before it restarts moto_server (a restart
#: empties the bucket, and the restarted servers' host tiers hold the next minute's chunks, so
#: an object fault after it found nothing to damage) and whose kills end before 85 s.
SEED = 10


def run_soak(workdir):
    """(exit code, soak.json, output) of one seeded run in `workdir`."""
    out = subprocess.run(
        [sys.executable, "-c", "import sys; from kvhal.cli import main; sys.exit(main())",
         "soak", "--minutes", str(MINUTES), "--seed", str(SEED), "--fault-gap-s", str(GAP_S),
         "--no-mooncake", "--workdir", str(workdir)],
        capture_output=True, text=True, timeout=1500, check=False)
    report = workdir / "soak.json"
    assert report.exists(), out.stdout[-3000:] + out.stderr[-3000:]
    return out.returncode, json.loads(report.read_text()), out.stdout + out.stderr[-3000:]


def test_a_seeded_soak_passes_every_check(tmp_path):
    """One soak (one test, so pytest-xdist never runs it twice at once): every answer right,
    every fault kind applied, nothing leaked, nobody let in, kvhal exercised, no request
    waiting past its bound."""
    code, report, output = run_soak(tmp_path)
    summary = report["summary"]
    assert summary["verdicts"].get("wrong", 0) == 0, output
    assert summary["requests"] >= 50, output
    failed = {k: n for k, n in summary["failures"].items() if n}
    assert failed == {}, failed
    assert summary["cross_tenant"] == []
    # kvhal's own per-request accounting reached the client (the cross-tenant check reads it)
    assert summary["kvhal_reported_tokens"] > 0
    assert len(summary["kvhal_tokens_by_tenant"]) >= 4
    # every killed server came back at its first start
    assert report["starts_refused"] == [], report["starts_refused"]
    expected = set(faultlib.KINDS)
    if report["mooncake_skipped"]:
        expected.discard("mooncake_restart")
    if not report["fs_mounted"]:
        expected.discard("fs_full")
    applied = {f["kind"] for f in report["faults"]
               if not f["what"].startswith("skipped") and not f["what"].endswith(" None")}
    assert applied >= expected, (sorted(expected - applied), report["faults"], output)
    checks = report["checks"]
    assert checks["dev_shm_kvhal"] == [] and checks["temp_files"] == []
    assert checks["left_processes"] == [] and checks["listening"] == []
    assert not os.path.ismount(tmp_path / "fs")  # a mount left would fail pytest's cleanup
    tried = {p["port"] for p in report["nokey_pulls"] if p["challenged"] == 2}
    assert tried == set(report["p2p_ports"]), report["nokey_pulls"]
    assert sum(p["bytes"] for p in report["nokey_pulls"]) == 0
    assert summary["kvhal_served_tokens"] >= MIN_SERVED * summary["reusable_prompt_tokens"]
    late = [r for r in report["requests"] if r["done_s"] - r["sent_s"] > r["wait_bound_s"]]
    assert late == []
    assert code == 0, output
