"""`kvhal fsck` on a hand-damaged directory and `kvhal bench tier`, as a user runs them."""
from __future__ import annotations

import importlib.util
import json
import mmap
import os
import resource
import subprocess
import sys
import time

import pytest

from kvhal.integrations.harness.bench.tier_disk import DiskLoop
from kvhal.tiers.chunk_format import record_nbytes
from kvhal.tiers.fs import FsTier
from kvhal.tiers.fs.format import QUARANTINE_DIR, chunk_path

from ..cli import kvhal, timed_kvhal
from .helpers import NAMESPACE, chunk_key, dead_pid, host_region, payload, store, temp_files


def assert_bench_passes_fit(result: dict, wall_s: float, cpu_s: float) -> None:
    """Every contender reports `repeats` write and read passes, and the time and CPU time its
    passes took, as their GB/s (of chunk_bytes x count) and CPU µs per chunk say, add up over
    all contenders to less than the whole command took (`timed_kvhal`)."""
    nbytes, count = result["chunk_bytes"] * result["count"], result["count"]
    passes = [(c["write_gbps"], c["read_gbps"], c["write_cpu_us"], c["read_cpu_us"])
              for c in result["contenders"]]
    assert {len(figures) for row in passes for figures in row} == {result["repeats"]}
    passes_s = sum(nbytes / 1e9 / gbps for w, r, _, _ in passes for gbps in w + r)
    passes_cpu_s = sum(us * count / 1e6 for _, _, w, r in passes for us in w + r)
    assert passes_s < wall_s, f"passes took {passes_s:.3f} s of a {wall_s:.3f} s command"
    assert passes_cpu_s < cpu_s, f"passes took {passes_cpu_s:.3f} CPU s of {cpu_s:.3f}"


def _damaged_dir(root) -> tuple[str, list[str]]:
    """Five 10000-byte chunks; then one bit-flipped, one truncated, one orphaned temp file."""
    host, array = host_region(1 << 20)
    tier = FsTier({"root_dir": str(root)}, host, NAMESPACE)
    paths = []
    for i in range(5):
        array[:10000] = payload(i, 10000)
        assert store(tier, chunk_key(NAMESPACE, i), 0, 10000).ok
        paths.append(chunk_path(tier.ns_dir, chunk_key(NAMESPACE, i)))
    tier.close()
    with open(paths[1], "r+b") as f:
        f.seek(5000)
        byte = f.read(1)[0]
        f.seek(5000)
        f.write(bytes([byte ^ 0x10]))
    os.truncate(paths[3], 6000)
    temp = os.path.join(os.path.dirname(paths[0]),
                        f"{chunk_key(NAMESPACE, 9).hex()}.{dead_pid()}.ab.tmp")
    with open(temp, "wb") as f:
        f.write(b"x" * 777)
    os.utime(temp, (time.time() - 60,) * 2)
    return tier.ns_dir, paths


def test_fsck_reports_damage_and_exits_nonzero(tmp_path):
    _, paths = _damaged_dir(tmp_path)

    out = kvhal("fsck", str(tmp_path), "--json")

    assert out.returncode == 1, out.stderr
    report = json.loads(out.stdout)                  # --json: stdout is the JSON alone
    assert out.stderr == ("kvhal fsck: 2 corrupt chunk file(s); run with --repair to "
                          "quarantine them\n")
    assert {k: report[k] for k in ("namespaces", "good", "good_bytes", "corrupt",
                                   "corrupt_bytes", "orphaned_temps", "orphaned_temp_bytes",
                                   "quarantined", "other_files")} == {
        "namespaces": 1, "good": 3, "good_bytes": 3 * 16384, "corrupt": 2,
        "corrupt_bytes": 16384 + 6000, "orphaned_temps": 1, "orphaned_temp_bytes": 777,
        "quarantined": 0, "other_files": 0}     # a temp file is not an "other" file
    assert sorted(report["problems"]) == sorted([[paths[1], "checksum mismatch"],
                                                 [paths[3], "record size 6000 != expected 16384"]])


def test_fsck_repair_quarantines_and_cleans_then_the_directory_is_clean(tmp_path):
    ns_dir, paths = _damaged_dir(tmp_path)

    repaired = kvhal("fsck", str(tmp_path), "--repair")
    again = kvhal("fsck", str(tmp_path), "--json")

    assert repaired.returncode == 0, repaired.stderr
    assert ("kvhal fsck: quarantined 2 corrupt chunk file(s), removed 1 orphaned temp "
            "file(s)") in repaired.stdout
    assert again.returncode == 0
    report = json.loads(again.stdout)
    assert (report["good"], report["corrupt"], report["orphaned_temps"],
            report["quarantined"]) == (3, 0, 0, 2)
    assert temp_files(ns_dir) == []
    assert len(os.listdir(os.path.join(ns_dir, QUARANTINE_DIR))) == 2
    assert [os.path.exists(p) for p in paths] == [True, False, True, False, True]


def test_fsck_of_a_missing_directory_says_why(tmp_path):
    out = kvhal("fsck", str(tmp_path / "nope"))
    assert out.returncode == 1
    assert out.stderr.strip() == f"kvhal fsck: error: not a directory: {tmp_path / 'nope'}"



def test_fsck_of_a_namespace_folder_points_at_its_parent(tmp_path):
    ns_dir, _ = _damaged_dir(tmp_path)
    out = kvhal("fsck", ns_dir)
    assert out.returncode == 1
    assert out.stderr.strip() == (f"kvhal fsck: error: {ns_dir} is a namespace folder; pass the "
                                  f"tier's root_dir (its parent, {tmp_path})")


def test_fsck_of_odd_directories_finds_nothing_and_touches_nothing(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "a_file").write_bytes(b"x")
    garbage = tmp_path / "garbage"
    (garbage / NAMESPACE.hex() / "chunks" / "zz" / "deeper").mkdir(parents=True)
    (garbage / NAMESPACE.hex() / "chunks" / "00").write_bytes(b"not a folder")
    (garbage / ("cd" * 16)).write_bytes(b"a file named like a namespace")
    before = sorted(str(p) for p in garbage.rglob("*"))

    outs = {name: kvhal("fsck", str(tmp_path / name), "--repair", "--json")
            for name in ("empty", "a_file", "garbage")}

    assert outs["a_file"].returncode == 1
    assert outs["a_file"].stderr.strip() == (f"kvhal fsck: error: not a directory: "
                                             f"{tmp_path / 'a_file'}")
    for name in ("empty", "garbage"):
        assert outs[name].returncode == 0, outs[name].stderr
        report = json.loads(outs[name].stdout)
        assert (report["namespaces"], report["good"], report["corrupt"],
                report["other_files"]) == (0 if name == "empty" else 1, 0, 0, 0)
    assert sorted(str(p) for p in garbage.rglob("*")) == before



def test_fsck_never_reads_a_huge_file_with_a_chunk_name_into_memory(tmp_path):
    ns_dir, paths = _damaged_dir(tmp_path)
    os.truncate(paths[2], 3 << 30)                 # sparse 3 GiB, header intact
    limit = 1 << 30                                # fsck must run in 1 GiB of address space
    out = subprocess.run([sys.executable, "-m", "kvhal.cli", "fsck", str(tmp_path), "--json"],
                         capture_output=True, text=True, timeout=300,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit,) * 2))
    assert out.returncode == 1, out.stderr
    report = json.loads(out.stdout)
    assert (report["good"], report["corrupt"], report["corrupt_bytes"]) == (
        2, 3, 16384 + 6000 + (3 << 30))
    assert [paths[2], f"record size {3 << 30} != expected 16384"] in report["problems"]


def test_bench_tier_json_reports_every_pass_of_kvhal_raw_vllm_and_the_disk(tmp_path):
    """Besides the rows: the kvhal tier's own counters and the files on disk show 3 passes of
    8 chunks of 64 KiB moved (fresh keys each pass), and the passes fit in the command's time.
    Fails with the same keys every pass (bench `block_hash` without the pass): 8 chunks stored,
    passes 2 and 3 store nothing."""
    out, wall_s, cpu_s = timed_kvhal("bench", "tier", "--chunk-bytes", "64KiB", "--count", "8",
                                     "--repeats", "3", "--root-dir", str(tmp_path), "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert (result["tier"], result["chunk_bytes"], result["count"]) == ("fs", 65536, 8)
    has_vllm = importlib.util.find_spec("vllm") is not None
    names = [c["name"] for c in result["contenders"]]
    assert names == ["kvhal fs", "raw loop"] + (["vllm fs"] if has_vllm else []) + [
        "disk (no files)"]
    kvhal_fs, raw = result["contenders"][:2]
    # 16 threads load, 16 store and also load while no store is queued: the loops read on 32
    assert (kvhal_fs["threads"], raw["threads"], raw["durability"]) == (
        "16+16", "32+16", kvhal_fs["durability"])
    disk = result["contenders"][-1]
    assert (disk["threads"], disk["o_direct"]) == ("32+16", kvhal_fs["o_direct_writes"])
    assert sorted(os.listdir(tmp_path)) == ["disk.img", "raw0", "raw1", "raw2", "tier"] + (
        ["vllm"] if has_vllm else [])
    assert os.path.getsize(tmp_path / "disk.img") == 8 * 65536   # written once, overwritten
    stats = result["kvhal_stats"]
    assert (stats["bytes_stored"], stats["bytes_loaded"], stats["chunks"]) == (
        3 * 8 * 65536, 3 * 8 * 65536, 3 * 8)
    assert sorted(p.stat().st_size for p in (tmp_path / "tier").rglob("*.kv")) == [
        record_nbytes(65536)] * (3 * 8)
    for rep in range(3):
        assert sorted(p.stat().st_size for p in (tmp_path / f"raw{rep}").iterdir()) == [
            65536] * 8
    assert_bench_passes_fit(result, wall_s, cpu_s)
    measured = ("raw", "disk") + (("vllm",) if has_vllm else ())
    assert all(isinstance(result[f"{d}_vs_{c}"], float) for d in ("write", "read")
               for c in measured)
    for c in result["contenders"]:
        assert c["write_median_gbps"] == sorted(c["write_gbps"])[1]
        assert c["read_median_cpu_us"] == sorted(c["read_cpu_us"])[1]
        assert min(c["write_cpu_us"] + c["read_cpu_us"]) > 0    # every pass makes system calls
    if has_vllm:
        vllm = result["contenders"][2]
        assert (vllm["threads"], result["vllm"]) == ("16+16", "vllm fs tier measured")
    else:
        assert (result["vllm"], result["read_vs_vllm"]) == ("vllm not installed: skipped", None)


def test_bench_tier_full_evicts_with_every_store_and_recycles_the_files(tmp_path):
    out = kvhal("bench", "tier", "--full", "--chunk-bytes", "64KiB", "--count", "8",
                "--repeats", "3", "--root-dir", str(tmp_path), "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert [c["name"] for c in result["contenders"]] == ["kvhal fs", "raw loop",
                                                         "disk (no files)"]
    assert (result["full"], result["vllm"]) == (
        True, "--full: vllm's fs tier has no capacity bound: skipped")
    stats = result["kvhal_stats"]
    # filled with 8 chunks first: each of the 3 x 8 timed stores evicts one, in its file
    assert (stats["evictions"], stats["files_recycled"], stats["chunks"]) == (24, 24, 8)
    assert stats["max_bytes"] == stats["used_bytes"] == 8 * (65536 + 4096)
    raw = {rep: len(os.listdir(tmp_path / f"raw{rep}")) for rep in (-1, 0, 1, 2)}
    assert raw == {-1: 0, 0: 0, 1: 0, 2: 8}            # each write deleted the last pass's file


def test_bench_tier_refuses_a_root_dir_that_holds_files(tmp_path):
    (tmp_path / "left-over").write_bytes(b"x")
    out = kvhal("bench", "tier", "--count", "1", "--repeats", "1", "--root-dir", str(tmp_path))
    assert out.returncode != 0
    assert f"--root-dir: {str(tmp_path)!r} is not empty" in out.stderr
    assert os.listdir(tmp_path) == ["left-over"]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_bench_tier_says_why_vllms_tier_fails_a_chunk_size_o_direct_cannot_take(tmp_path):
    out = kvhal("bench", "tier", "--chunk-bytes", "4097", "--count", "2", "--repeats", "1",
                "--root-dir", str(tmp_path / "run"))
    if out.returncode == 0:                      # a filesystem without O_DIRECT: vLLM buffers
        return
    assert ("vllm fs tier: 2 jobs failed (its O_DIRECT I/O takes only multiples of 4096 bytes, "
            "not 4097-byte chunks: use --no-vllm or another --chunk-bytes)") in out.stderr


def test_bench_tier_full_is_for_the_fs_tier_only(tmp_path):
    out = kvhal("bench", "tier", "--tier", "obj", "--full", "--count", "2", "--json")
    assert out.returncode != 0
    assert "--full: only for --tier fs (got 'obj')" in out.stderr


@pytest.mark.parametrize("chunk", [4096 * 3, 6000])
def test_bench_disk_loop_overwrites_one_file_in_place_and_reads_it_back(tmp_path, chunk):
    region = mmap.mmap(-1, chunk * 4)
    host = memoryview(region)
    host[:] = os.urandom(len(host))
    disk = DiskLoop(str(tmp_path), host, chunk, 4, (2, 3))
    assert disk.o_direct is (chunk == 4096 * 3)           # an unaligned chunk goes buffered
    first, inode = bytes(host), os.stat(tmp_path / "disk.img").st_ino
    host[:] = os.urandom(len(host))
    disk.write(0)
    assert (tmp_path / "disk.img").read_bytes() == bytes(host) != first
    second = bytes(host)
    host[:] = b"\0" * len(host)
    disk.read(1)
    assert bytes(host) == second
    assert os.listdir(tmp_path) == ["disk.img"] and os.stat(tmp_path / "disk.img").st_ino == inode


def test_bench_tier_says_how_adaptive_moved_large_chunks(tmp_path):
    # 1 MiB chunks under the default o_direct "adaptive": 2 passes of 16 chunks (two windows,
    # `large_io.WINDOW`): the first window of writes goes O_DIRECT, the second buffered; reads
    # are not adaptive (all O_DIRECT). Where the filesystem refuses O_DIRECT nothing is.
    import re

    from kvhal.tiers.fs.fileio import probe_o_direct
    from kvhal.tiers.fs.large_io import WINDOW

    out = kvhal("bench", "tier", "--chunk-bytes", "1MiB", "--count", str(WINDOW),
                "--repeats", "2", "--no-vllm", "--root-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    if probe_o_direct(str(tmp_path)):
        assert (f"kvhal fs adaptive: {WINDOW} of {2 * WINDOW} large writes with O_DIRECT\n"
                in out.stdout), out.stdout
        # the O_DIRECT column: kvhal picks as it goes; the raw loop moves every file O_DIRECT
        assert re.search(r"│ kvhal fs +│ 16\+16 +│ process +│ adaptive +│", out.stdout)
        assert re.search(r"│ raw loop +│ 32\+16 +│ process +│ on +│", out.stdout)
    else:
        assert "adaptive" not in out.stdout
