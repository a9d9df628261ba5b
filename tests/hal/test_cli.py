"""`kvhal doctor` and `kvhal bench copy` as a user runs them."""
from __future__ import annotations

import json
import subprocess
import sys


def kvhal(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvhal.cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_doctor_reports_cpu_available_and_accelerators_with_reason():
    out = kvhal("doctor", "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)["backends"]}
    assert rows["cpu"]["available"] is True
    assert rows["cpu"]["capabilities"]["native_copy_2d"] is True
    for name in ("cuda", "rocm"):
        assert rows[name]["available"] is False
        assert rows[name]["reason"]


def test_bench_copy_json_reports_every_size_with_ratios():
    out = kvhal("bench", "copy", "--sizes", "4KiB", "256KiB", "--repeats", "1", "--json")
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout)["results"]
    assert [r["block_bytes"] for r in results] == [4096, 262144]
    assert [r["blocks"] for r in results] == [1000, 1000]
    for r in results:
        assert r["d2h_gbps"] > 0 and r["memcpy_gbps"] > 0 and r["d2h_ratio"] > 0


def test_bench_copy_rejects_bad_size():
    out = kvhal("bench", "copy", "--sizes", "0KiB")
    assert out.returncode == 2
    assert "block size must be positive" in out.stderr


def test_bench_copy_rejects_block_beyond_the_per_direction_cap():
    out = kvhal("bench", "copy", "--sizes", "2GiB")
    assert out.returncode == 2
    assert "block size must be at most 1 GiB" in out.stderr and "Traceback" not in out.stderr


def test_bench_copy_rejects_zero_repeats():
    out = kvhal("bench", "copy", "--sizes", "4KiB", "--repeats", "0")
    assert out.returncode == 2
    assert "repeats must be at least 1, got '0'" in out.stderr


def test_bench_copy_labels_sub_kib_blocks_in_bytes():
    out = kvhal("bench", "copy", "--sizes", "3", "1536", "--repeats", "1")
    assert out.returncode == 0, out.stderr
    assert "│ 3 B " in out.stdout and "│ 1536 B " in out.stdout and "0 KiB" not in out.stdout


def test_bench_bad_counts_are_usage_errors_naming_the_value():
    for argv in (("bench", "engine", "--chunks", "0"), ("bench", "engine", "--blocks-per-chunk",
                                                          "0"),
                 ("bench", "tier", "--count", "-1"), ("bench", "tier", "--repeats", "0"),
                 ("bench", "layout", "--repeats", "0"), ("demo", "--conversations", "0"),
                 ("demo", "--turns", "-1"), ("bench", "vllm", "--samples", "0")):
        out = kvhal(*argv)
        assert out.returncode == 2, (argv, out.stderr)
        assert out.stderr.splitlines()[-1].endswith(
            f"error: argument {argv[-2]}: must be a positive integer, got '{argv[-1]}'"), argv


def test_bench_tier_unknown_tier_and_bad_config_are_one_line():
    out = kvhal("bench", "tier", "--tier", "nope")
    assert (out.returncode, out.stderr) == (
        1, "kvhal bench: error: --tier: 'nope' is not a registered tier type; registered: "
           "memory, fs, p2p, obj, mooncake\n")
    out = kvhal("bench", "tier", "--config", "[1]")
    assert (out.returncode, out.stderr) == (
        1, "kvhal bench: error: --config: must be a JSON object, got list\n")


def test_bench_vllm_context_not_a_block_multiple_is_one_line():
    out = kvhal("bench", "vllm", "--context-tokens", "100")
    assert (out.returncode, out.stderr) == (
        1, "kvhal bench: error: --context-tokens: must be a multiple of 128 (the demo model's "
           "block size), got 100\n")
def test_bench_copy2d_json_compares_loop_and_batch_of_one_vllm_cpu_chunk():
    out = kvhal("bench", "copy2d", "--geometries", "llama-3.1-8b", "--blocks-per-chunk", "1",
                "--repeats", "1", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["results"]
    assert [(r["layout"], r["direction"]) for r in rows] == [("vllm-cpu", "h2d"),
                                                             ("vllm-cpu", "d2h")]
    for r in rows:  # 32 layers x 8 heads x (K, V), 16 tokens x 128 bf16 each
        assert (r["copies_2d"], r["chunk_bytes"]) == (512, 2 << 20)
        assert min(r["loop_us"], r["batch_us"], r["speedup"]) > 0


def test_bench_copy2d_rejects_unknown_layout():
    out = kvhal("bench", "copy2d", "--layouts", "nope")
    assert out.returncode == 2 and "invalid choice: 'nope'" in out.stderr
