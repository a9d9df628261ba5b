"""The seeded soak CI runs: `kvhal soak` as a subprocess for `MINUTES` of load with a fault
every `GAP_S` seconds on average, so every fault kind comes once; its report's real values are
checked (not only its exit code): 0 wrong answers, 0 cross-tenant hits, nothing leaked, every
fault kind applied, a keyless p2p client got 0 bytes from each server, kvhal served at least a
tenth of the reusable prompt tokens. Without the mooncake tier: a server killed with -9 failed
to join the Mooncake pool at its restart ("setup returned -1", 3 tries), which stops the run
(see the report of this change)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from kvhal.integrations.harness.soak.driver import MIN_SERVED
from kvhal.integrations.harness.soak import faults as faultlib

pytest.importorskip("vllm", reason="the soak runs real vLLM servers (the `vllm` extra)")
pytestmark = pytest.mark.slow

MINUTES = 2.0
GAP_S = 7.0
SEED = 38


@pytest.fixture(scope="module")
def soak(tmp_path_factory):
    """(exit code, soak.json, output) of one seeded run."""
    workdir = tmp_path_factory.mktemp("soak")
    out = subprocess.run(
        [sys.executable, "-c", "import sys; from kvhal.cli import main; sys.exit(main())",
         "soak", "--minutes", str(MINUTES), "--seed", str(SEED), "--fault-gap-s", str(GAP_S),
         "--no-mooncake", "--workdir", str(workdir)],
        capture_output=True, text=True, timeout=600, check=False)
    report = workdir / "soak.json"
    assert report.exists(), out.stdout[-3000:] + out.stderr[-3000:]
    return out.returncode, json.loads(report.read_text()), out.stdout + out.stderr[-3000:]


def test_the_soak_passes_with_every_answer_right(soak):
    code, report, output = soak
    summary = report["summary"]
    assert summary["verdicts"].get("wrong", 0) == 0, output
    assert summary["requests"] >= 50, output
    assert all(n == 0 for n in summary["failures"].values()), summary["failures"]
    assert summary["cross_tenant"] == []
    assert code == 0, output


def test_every_fault_kind_was_applied(soak):
    _, report, output = soak
    expected = set(faultlib.KINDS)
    if report["mooncake_skipped"]:
        expected.discard("mooncake_restart")
    if not report["fs_mounted"]:
        expected.discard("fs_full")
    applied = {f["kind"] for f in report["faults"]
               if not f["what"].startswith("skipped") and not f["what"].endswith(" None")}
    assert applied >= expected, (sorted(expected - applied), report["faults"], output)


def test_nothing_leaked_and_nobody_was_let_in(soak):
    _, report, _ = soak
    checks = report["checks"]
    assert checks["dev_shm_kvhal"] == [] and checks["temp_files"] == []
    assert checks["left_processes"] == [] and checks["listening"] == []
    assert checks["fs_bytes"] <= checks["fs_budget"]
    tried = {p["port"] for p in report["nokey_pulls"] if p["challenged"] == 2}
    assert tried == set(report["p2p_ports"]), report["nokey_pulls"]
    assert sum(p["bytes"] for p in report["nokey_pulls"]) == 0


def test_kvhal_served_and_no_request_waited_past_its_bound(soak):
    _, report, _ = soak
    summary = report["summary"]
    assert summary["kvhal_served_tokens"] >= MIN_SERVED * summary["reusable_prompt_tokens"]
    late = [r for r in report["requests"] if r["done_s"] - r["sent_s"] > r["wait_bound_s"]]
    assert late == []
