"""`kvhal bench p2p` runs end to end between two processes and reports every figure."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_bench_p2p_json_reports_medians_ratio_and_cpu():
    out = subprocess.run([sys.executable, "-m", "kvhal.cli", "bench", "p2p", "--count", "4",
                          "--chunk-bytes", "256KiB", "--repeats", "2", "--json"],
                         capture_output=True, text=True, timeout=300)
    result = json.loads(out.stdout)

    assert out.returncode == (0 if result["ratio"] >= 0.9 else 1)
    assert (result["chunk_bytes"], result["count"], result["repeats"]) == (256 << 10, 4, 2)
    assert min(result["p2p_gbps"], result["raw_tcp_gbps"], result["zmq_gbps"]) > 0
    assert result["p2p_p50_ms"] <= result["p2p_p99_ms"]
    assert set(result["cpu_ms_per_chunk"]) == {"p2p", "raw", "zmq"}
    assert set(result["cpu_ms_per_chunk"]["p2p"]) == {"client", "server"}
    assert result["hash_ms_per_chunk"] > 0
