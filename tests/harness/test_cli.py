"""`kvhal replay` as a user runs it: report, JSON, malformed traces, sweeps and plots."""
from __future__ import annotations

import json
import time

from ..cli import kvhal

from .conftest import mooncake

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TRACE = [mooncake([i]) for i in (1, 2, 1, 3, 4, 1)]  # see test_replay: LRU vs ARC


def test_json_report_has_hits_by_level_and_reference(write_trace):
    path = write_trace(TRACE)
    out = kvhal("replay", str(path), "--device-bytes", "32K", "--config",
                '{"cpu_bytes_to_use": 65536, "eviction_policy": "arc"}', "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["hit_tokens"] == {"device": 0, "host": 1024}
    assert report["reference"]["hit_tokens"] == 1024
    assert report["hit_ratio"] == report["reference"]["hit_ratio"] == 1024 / (6 * 512)
    assert report["traffic"]["host"]["d2h"] == {"chunks": 4, "nbytes": 4 * 32768}
    assert report["capacities"] == {"device": 32768, "host": 65536}
    assert report["verified_chunks"] == 2


def test_table_report_prints_ratio(write_trace):
    out = kvhal("replay", str(write_trace(TRACE)), "--device-bytes", "32K")
    assert out.returncode == 0, out.stderr
    assert "reference ratio (unlimited capacity)" in out.stdout
    assert "0.3333 (1024 tokens, 4 chunks)" in out.stdout


def test_malformed_line_fails_in_one_line_naming_line_and_field(write_trace):
    path = write_trace(TRACE[:2] + ['{"timestamp": 0, "input_length": 512, "hash_ids": [1]}'])
    out = kvhal("replay", str(path))
    assert out.returncode == 1
    assert out.stderr == f"kvhal replay: error: {path} line 3: output_length: missing\n"


def test_bad_config_names_the_key(write_trace):
    out = kvhal("replay", str(write_trace(TRACE)), "--config", '{"cpu_bytes_to_use": 0}')
    assert out.returncode == 1
    assert out.stderr.startswith("kvhal replay: error: cpu_bytes_to_use: must be an integer")


def test_sweep_replays_per_capacity_and_plots(write_trace, tmp_path):
    plot = tmp_path / "sweep.png"
    out = kvhal("replay", str(write_trace(TRACE)), "--device-bytes", "32K", "--sweep",
                "host=32K,64K,128K", "--plot", str(plot), "--json")
    assert out.returncode == 0, out.stderr
    reports = json.loads(out.stdout)["reports"]
    assert [r["capacities"]["host"] for r in reports] == [32768, 65536, 131072]
    # LRU: 1 slot never hits (no request repeats the previous one), 2 slots hit the 2nd "1",
    # 4 slots hold everything.
    assert [r["hit_tokens"]["host"] for r in reports] == [0, 512, 1024]
    assert plot.read_bytes()[:8] == PNG_MAGIC


def test_timeline_plot(write_trace, tmp_path):
    plot = tmp_path / "timeline.png"
    out = kvhal("replay", str(write_trace(TRACE)), "--device-bytes", "32K", "--plot", str(plot))
    assert out.returncode == 0, out.stderr
    assert plot.read_bytes()[:8] == PNG_MAGIC


def test_sweep_of_unknown_level_names_it(write_trace):
    out = kvhal("replay", str(write_trace(TRACE)), "--sweep", "fs=1G")
    assert out.returncode == 1
    assert "--sweep: 'fs' is neither device, host nor a secondary tier type" in out.stderr


def test_bench_replay_reports_wall_time_and_engine_time(write_trace, tmp_path):
    """The counts are the trace's (6 requests; the 2nd and 3rd "1" hit: 1024 of 3072 tokens,
    as with unlimited capacity), and the times are seconds measured inside one another: the
    replay and the removal inside the command, the command inside this test's own clock
    (`perf_counter` is system-wide monotonic). Fails with `command_s` reported in ms."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    t0 = time.perf_counter()
    out = kvhal("bench", "replay", "--trace", str(write_trace(TRACE)), "--tmp-dir",
                str(scratch), "--json")
    elapsed_s = time.perf_counter() - t0
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout)
    assert figures["requests"] == len(TRACE)
    assert figures["hit_tokens"] == {"device": 1024, "host": 0, "fs": 0}  # 64 MiB device pool
    assert figures["hit_ratio"] == figures["reference_hit_ratio"] == 1024 / (6 * 512)
    assert figures["chunks_moved"] == 4 and figures["verified_chunks"] == 2
    assert list(scratch.iterdir()) == []  # the fs tier's folder is removed
    assert 0 < figures["wall_s"] + figures["remove_s"] <= figures["command_s"] < elapsed_s


def test_token_id_trace_replays_by_chunk_tokens(write_trace):
    shared = list(range(40))
    path = write_trace([{"prompt_token_ids": shared + [1000 + i for i in range(8)]},
                        {"prompt_token_ids": [5000 + i for i in range(64)]},  # flushes device
                        {"prompt_token_ids": shared + [7] * 30}])
    out = kvhal("replay", str(path), "--chunk-tokens", "16", "--device-bytes", "4K", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    # 16-token chunks of 64 B/token: requests 1 and 3 share chunks 0 and 1 (tokens 0..31), and
    # request 2 took all 4 device blocks in between, so the host serves them.
    assert report["chunk_bytes"] == 16 * 64
    assert report["hit_tokens"] == {"device": 0, "host": 32}
    assert report["reference"]["hit_tokens"] == 32


def test_unknown_layout_is_refused_in_one_line(write_trace):
    out = kvhal("replay", str(write_trace(TRACE)), "--layout", "nope")
    assert out.returncode == 1
    assert out.stderr.startswith("kvhal replay: error: --layout: unknown layout 'nope'; "
                                 "registered: packed-hnd")


def test_empty_trace_is_refused_naming_the_file(write_trace):
    path = write_trace([])
    out = kvhal("replay", str(path))
    assert (out.returncode, out.stderr) == (
        1, f"kvhal replay: error: {path}: no requests to replay (empty trace)\n")


def test_non_utf8_trace_names_file_line_and_byte(write_trace, tmp_path):
    path = tmp_path / "bin.jsonl"
    path.write_bytes(json.dumps(TRACE[0]).encode() + b"\n\xff\xfe\n")
    out = kvhal("replay", str(path))
    assert (out.returncode, out.stderr) == (
        1, f"kvhal replay: error: {path} line 2: json: not UTF-8 text (byte 0)\n")


def test_non_utf8_config_file_names_it(write_trace, tmp_path):
    config = tmp_path / "config.json"
    config.write_bytes(b'{"cpu_bytes_to_use": \xff}')
    out = kvhal("replay", str(write_trace(TRACE)), "--config", str(config))
    assert (out.returncode, out.stderr) == (
        1, f"kvhal replay: error: {config}: not UTF-8 text (byte 21)\n")


def test_bad_numbers_are_usage_errors_naming_the_value(write_trace):
    path = str(write_trace(TRACE))
    for option, value, reason in (("--layers", "0", "must be a positive integer, got '0'"),
                                  ("--limit", "-1", "must be a positive integer, got '-1'"),
                                  ("--chunk-tokens", "x", "not an integer: 'x'"),
                                  ("--time-scale", "nan", "must be a finite number ≥ 0, got "
                                                          "'nan'"),
                                  ("--prefill-us-per-token", "-1", "must be a finite number ≥ "
                                                                   "0, got '-1'")):
        out = kvhal("replay", path, option, value)
        assert out.returncode == 2, (option, out.stderr)
        assert out.stderr.splitlines()[-1] == (f"kvhal replay: error: argument {option}: "
                                               f"{reason}")


def test_bad_plot_path_fails_before_the_replay(write_trace, tmp_path):
    path = str(write_trace(TRACE))
    missing = tmp_path / "no" / "such"
    out = kvhal("replay", path, "--plot", str(missing / "x.png"))
    assert (out.returncode, out.stdout) == (1, "")
    assert out.stderr == f"kvhal replay: error: --plot: folder {str(missing)!r} does not exist\n"
    out = kvhal("replay", path, "--plot", str(tmp_path / "plot.txt"))
    assert (out.returncode, out.stdout) == (1, "")
    assert out.stderr.startswith(f"kvhal replay: error: --plot: {str(tmp_path / 'plot.txt')!r} "
                                 "is not an image file name; use one of ")
    assert ".png" in out.stderr and not (tmp_path / "plot.txt").exists()


def test_mla_tp2_reports_geometry_and_bytes_per_rank(write_trace):
    path = write_trace([mooncake([1, 2]), mooncake([3, 4]), mooncake([1, 2])])
    chunk = 512 * 576 * 2
    out = kvhal("replay", str(path), "--mla", "--latent-size", "576", "--layers", "1",
                "--dtype", "bf16", "--tp", "2", "--device-bytes", str(2 * chunk), "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["geometry"] == {"kind": "mla", "layers": 1, "latent_size": 576,
                                  "dtype": "bf16", "bytes_per_token": 1152, "layout": "mla"}
    assert (report["tp"], report["chunk_bytes"], report["verified_chunks"]) == (2, chunk, 2)
    assert report["hit_tokens"] == {"device": 0, "host": 1024}
    assert report["rank_bytes"] == [{"d2h": 4 * chunk, "h2d": 2 * chunk},
                                    {"d2h": 0, "h2d": 2 * chunk}]
    table = kvhal("replay", str(path), "--mla", "--tp", "2", "--device-bytes", str(2 * chunk))
    assert "mla: 1 layers × 576 bfloat16, layout mla, TP 2" in table.stdout
    assert f"rank 0: {4 * chunk} / {2 * chunk}, rank 1: 0 / {2 * chunk}" in table.stdout


def test_bad_mla_flag_combinations_name_the_flags(write_trace):
    path = str(write_trace(TRACE))
    for args, message in (
            (["--latent-size", "576"], "--latent-size needs --mla"),
            (["--mla", "--kv-heads", "2"], "--mla and --kv-heads exclude each other"),
            (["--mla", "--preset", "deepseek-v3"], "--preset and --mla exclude each other"),
            (["--tp", "2"], "--tp: 2 needs an MLA geometry"),
            (["--mla", "--layout", "packed-hnd"], "--layout: "),
            (["--mla", "--device-bytes", "512K"], "--device-bytes: 524288 bytes hold 0 "
                                                  "chunks of 589824 bytes"),
            (["--mla", "--tp", "100000"], "--device-bytes 1073741824 × --tp 100000 × "
                                          "--instances 1 = 107374182400000 bytes")):
        out = kvhal("replay", path, *args)
        assert out.returncode == 1, (args, out.stderr)
        assert out.stderr.startswith(f"kvhal replay: error: {message}"), (args, out.stderr)
        assert len(out.stderr.splitlines()) == 1, out.stderr
