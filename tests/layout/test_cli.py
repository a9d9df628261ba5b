"""`kvhal layout` as a user runs it."""
from __future__ import annotations

import json
import subprocess
import sys


def kvhal(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvhal.cli", *args], capture_output=True,
                          text=True, timeout=120)


def test_layout_json_reports_every_rank():
    out = kvhal("layout", "--layers", "32", "--kv-heads", "8", "--head-size", "128",
                "--block-size", "16", "--tp", "2", "--blocks-per-chunk", "16",
                "--attention", "vllm-cpu", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["format_id"] == "kvhal-hnd-v1" and report["layouts"] == ["vllm-cpu"]
    assert report["ranks"][1] == {
        "rank": 1, "writer": True, "device_block_bytes": 32 * 32768,
        "device_block_mib": 1.0, "canonical_chunk_bytes": 32 * 16 * 65536,
        "runs_per_page": [8], "store_runs_per_chunk": 8 * 16 * 32,
        "load_runs_per_chunk": 8 * 16 * 32, "copies_2d_per_chunk": 8 * 16 * 32}


def test_layout_table_marks_replica_ranks():
    out = kvhal("layout", "--layers", "27", "--mla-latent", "576", "--block-size", "64",
                "--tp", "2")
    assert out.returncode == 0, out.stderr
    assert "kvhal-hnd-v1 · mla · TP 2" in out.stdout
    assert "1990656" in out.stdout and "1.898" in out.stdout
    assert [line.split("│")[2].strip() for line in out.stdout.splitlines()
            if line.startswith("│")] == ["yes", "no"]


def test_layout_refusal_is_one_line_naming_the_layers():
    out = kvhal("layout", "--layers", "4", "--kv-heads", "6", "--head-size", "64",
                "--block-size", "16", "--tp", "4")
    assert out.returncode == 1
    assert out.stderr == ("kvhal layout: error: groups[0] (layers 0-3, full): 6 KV heads do "
                          "not split evenly over tp_size 4\n")


def test_layout_needs_heads_without_mla():
    out = kvhal("layout", "--layers", "4", "--block-size", "16")
    assert out.returncode == 1
    assert "--kv-heads and --head-size are required without --mla-latent" in out.stderr


def test_layout_refuses_a_tp_size_below_one():
    out = kvhal("layout", "--layers", "4", "--kv-heads", "8", "--head-size", "64",
                "--block-size", "16", "--tp", "0", "--json")
    assert (out.returncode, out.stdout) == (1, "")
    assert out.stderr == "kvhal layout: error: --tp: must be a positive int, got 0\n"


def test_layout_refuses_kv_heads_with_mla():
    out = kvhal("layout", "--layers", "4", "--mla-latent", "576", "--kv-heads", "8",
                "--block-size", "64")
    assert (out.returncode, out.stdout) == (1, "")
    assert "--kv-heads and --head-size do not apply with --mla-latent" in out.stderr


def test_layout_prints_per_group_chunk_and_host_bytes_of_a_hybrid_geometry():
    # Gemma-3-like: 2 full + 2 sliding-window layers, 2 KV heads of 64, bf16, 128-token blocks.
    out = kvhal("layout", "--layers", "2", "--kv-heads", "2", "--head-size", "64",
                "--block-size", "128", "--sliding-layers", "2", "--sliding-window", "256",
                "--mamba-layers", "1", "--mamba-state-bytes", "5000",
                "--cpu-bytes", str(64 << 20), "--json")
    assert out.returncode == 0, out.stderr
    slots = (64 << 20) // (131072 + 131072 + 8192)
    assert json.loads(out.stdout)["groups"] == [
        {"group": 0, "kind": "full", "layers": 2, "chunk_bytes": 131072, "slot_bytes": 131072,
         "slots": slots, "host_bytes": slots * 131072},
        {"group": 1, "kind": "sliding_window", "layers": 2, "chunk_bytes": 131072,
         "slot_bytes": 131072, "slots": slots, "host_bytes": slots * 131072},
        {"group": 2, "kind": "mamba", "layers": 1, "chunk_bytes": 5000, "slot_bytes": 8192,
         "slots": slots, "host_bytes": slots * 8192}]


def test_layout_refuses_a_state_group_with_chunks_of_several_blocks():
    # A state chunk is the one state at the chunk's end (vLLM keeps states per block boundary).
    out = kvhal("layout", "--layers", "2", "--kv-heads", "2", "--head-size", "64",
                "--block-size", "128", "--mamba-layers", "2", "--mamba-state-bytes", "35840",
                "--blocks-per-chunk", "2")
    assert (out.returncode, out.stdout) == (1, "")
    assert out.stderr == ("kvhal layout: error: groups[1] (layers 2-3, mamba): a state chunk is "
                          "the one state at the chunk's end, not one per block: map it with "
                          "blocks_per_chunk 1, got 2\n")
