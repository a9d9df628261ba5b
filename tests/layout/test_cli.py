"""`kvhal layout` as a user runs it."""
from __future__ import annotations

import json

from ..cli import kvhal


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


HYBRID = ("layout", "--layers", "2", "--kv-heads", "2", "--head-size", "64", "--block-size",
          "128", "--sliding-layers", "2", "--sliding-window", "256", "--mamba-layers", "1",
          "--mamba-state-bytes", "5000", "--cpu-bytes", str(64 << 20))


def test_layout_prints_per_group_chunk_and_host_bytes_of_a_hybrid_geometry():
    # Gemma-3-like: 2 full + 2 sliding-window layers, 2 KV heads of 64, bf16, 128-token blocks,
    # and a 5000-byte state layer. The state pool gets half the slots (state_slot_share 0.5):
    # 252 × (131072 + 131072) + 126 × 8192 = 67092480 bytes; 253 attention slots need 262144
    # more, beyond the 16384 left.
    out = kvhal(*HYBRID, "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["groups"] == [
        {"group": 0, "kind": "full", "layers": 2, "chunk_bytes": 131072, "slot_bytes": 131072,
         "share": 1.0, "slots": 252, "host_bytes": 252 * 131072},
        {"group": 1, "kind": "sliding_window", "layers": 2, "chunk_bytes": 131072,
         "slot_bytes": 131072, "share": 1.0, "slots": 252, "host_bytes": 252 * 131072},
        {"group": 2, "kind": "mamba", "layers": 1, "chunk_bytes": 5000, "slot_bytes": 8192,
         "share": 0.5, "slots": 126, "host_bytes": 126 * 8192}]
    assert (report["cpu_bytes"], report["host_bytes"], report["unused_bytes"]) == (
        64 << 20, 67092480, 16384)


def test_layout_table_shows_the_pools_of_a_state_slot_share():
    out = kvhal(*HYBRID, "--state-slot-share", "0.25")
    assert out.returncode == 0, out.stderr
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in out.stdout.splitlines()
            if line.startswith("│")][:3]
    # 254 × 262144 + 63 × 8192 = 67100672 ≤ 64 MiB < 255 × 262144 + 63 × 8192
    assert rows == [
        ["0", "full", "2", "131072", "131072", "1", "254", str(254 * 131072)],
        ["1", "sliding_window", "2", "131072", "131072", "1", "254", str(254 * 131072)],
        ["2", "mamba", "1", "5000", "8192", "0.25", "63", str(63 * 8192)]]
    assert f"bytes of {64 << 20} ({(64 << 20) - 67100672} unused)" in " ".join(out.stdout.split())


def test_layout_refuses_a_state_slot_share_outside_0_to_1():
    out = kvhal(*HYBRID, "--state-slot-share", "1.5")
    assert (out.returncode, out.stdout) == (1, "")
    assert out.stderr == ("kvhal layout: error: --state-slot-share: must be a number in (0, 1] "
                          "(host slots of a state group per slot of an attention group), got "
                          "1.5\n")


def test_layout_names_the_flag_of_a_bad_host_budget():
    # --cpu-bytes 0 is a bad budget, not "no budget given" (which would exit 0 with no pools)
    for value in ("0", "-5"):
        out = kvhal(*[a if a != str(64 << 20) else value for a in HYBRID])
        assert (out.returncode, out.stdout) == (1, "")
        assert out.stderr == (f"kvhal layout: error: --cpu-bytes: must be an integer ≥ 1, got "
                              f"{value}\n")


def test_layout_refuses_a_state_group_with_chunks_of_several_blocks():
    # A state chunk is the one state at the chunk's end (vLLM keeps states per block boundary).
    out = kvhal("layout", "--layers", "2", "--kv-heads", "2", "--head-size", "64",
                "--block-size", "128", "--mamba-layers", "2", "--mamba-state-bytes", "35840",
                "--blocks-per-chunk", "2")
    assert (out.returncode, out.stdout) == (1, "")
    assert out.stderr == ("kvhal layout: error: groups[1] (layers 2-3, mamba): a state chunk is "
                          "the one state at the chunk's end, not one per block: map it with "
                          "blocks_per_chunk 1, got 2\n")
