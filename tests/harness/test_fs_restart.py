"""The fs tier across replays in separate processes: hits resume from disk after a restart, and a
malformed trace in between fails up front without touching what the tier holds."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvhal.integrations.harness import read_trace, reference_hits
from kvhal.plugins import tiers

from .conftest import mooncake

pytestmark = pytest.mark.skipif("fs" not in tiers(), reason="the fs tier is not installed")


def kvhal_replay(trace, config: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvhal.cli", "replay", str(trace), "--config",
                           json.dumps(config), "--json", *args], capture_output=True, text=True,
                          timeout=300)


def chunk_files(root) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def test_restart_mid_replay_hits_resume_from_disk(write_trace, tmp_path):
    root = tmp_path / "fs"
    config = {"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [
        {"type": "fs", "root_dir": str(root)}]}
    first = write_trace([mooncake([1, 2, 3]), mooncake([4, 5])], "first.jsonl")
    out = kvhal_replay(first, config, "--device-bytes", "128K")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["traffic"]["fs"]["store"]["chunks"] == 5
    files = chunk_files(root)

    bad = write_trace([mooncake([1, 2, 3]), '{"timestamp": 0, "input_length": 1'], "bad.jsonl")
    out = kvhal_replay(bad, config, "--device-bytes", "128K")
    assert out.returncode == 1
    assert f"{bad} line 2: json: not valid JSON" in out.stderr
    assert chunk_files(root) == files

    second = write_trace([mooncake([1, 2, 3, 6]),  # 1,2,3 promoted from fs; 6 stored
                          mooncake([4, 5]),        # from fs; evicts 6 and 3 from the device
                          mooncake([1, 2, 3, 6])],  # 1,2 on the device; 3,6 in host memory
                         "second.jsonl")
    out = kvhal_replay(second, config, "--device-bytes", "128K")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["hit_tokens"] == {"device": 2 * 512, "host": 2 * 512, "fs": 5 * 512}
    assert report["traffic"]["fs"]["load"]["chunks"] == 5
    assert report["traffic"]["fs"]["store"]["chunks"] == 1


def test_restart_on_trace_slice_adds_up_to_the_reference(conversation_trace, write_trace,
                                                         tmp_path):
    lines = conversation_trace.read_text().splitlines()[:400]
    halves = [write_trace(lines[:200], "a.jsonl"), write_trace(lines[200:], "b.jsonl")]
    config = {"cpu_bytes_to_use": 1 << 30, "secondary_tiers": [
        {"type": "fs", "root_dir": str(tmp_path / "fs")}]}
    reports = []
    for half in halves:
        out = kvhal_replay(half, config, "--device-bytes", "8M")
        assert out.returncode == 0, out.stderr
        reports.append(json.loads(out.stdout))
    whole = reference_hits(read_trace(write_trace(lines, "all.jsonl")), 512)
    assert sum(r["total_hit_tokens"] for r in reports) == whole.hit_tokens
    assert reports[0]["hit_tokens"]["fs"] == 0
    assert reports[1]["hit_tokens"]["fs"] > 0
