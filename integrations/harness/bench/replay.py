"""`kvhal bench replay`: the full Mooncake conversation trace through the tiers, one command.

Replays a trace (default Mooncake's conversation trace at `../shared/traces/`, relative to the
working directory: the repository root in CI) with geometry `tiny` (64 B/token, 32 KiB chunks), a 64 MiB device pool, a 2 GiB
host tier and an 8 GiB fs tier in a fresh temporary folder, verification on. Prints wall time,
engine time per chunk (manager; worker), hit ratio next to the unlimited-capacity reference,
the time taken to remove the temporary folder (`remove_tree`, in parallel) and the whole
command's time, each as a share of the 5-minute target.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from kvhal.report import print_json, print_table, progress
from kvhal.tiers.fs.remove import remove_tree

from ..geometry import PRESETS
from ..reference import reference_hits
from ..replay import ReplayOptions, run_replay
from ..trace import read_trace

#: Target wall time of the whole conversation trace, seconds.
TARGET_WALL_S = 300.0
DEFAULT_TRACE = Path("../shared/traces/mooncake_conversation_trace.jsonl")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print its figures."""
    t_command = time.perf_counter()
    requests = read_trace(args.trace, limit=args.limit)
    reference = reference_hits(requests, 512)
    options = ReplayOptions(PRESETS["tiny"], device_bytes=64 << 20)
    # absolute: the fs tier refuses a relative root_dir (a --tmp-dir may be one)
    root = os.path.abspath(tempfile.mkdtemp(prefix="kvhal-bench-replay-", dir=args.tmp_dir))
    try:
        config = {"cpu_bytes_to_use": 2 << 30, "secondary_tiers": [
            {"type": "fs", "root_dir": root, "max_bytes": 8 << 30}]}
        with progress(disable=args.json) as bar:
            task = bar.add_task("bench replay", total=len(requests))
            report = run_replay(requests, reference, config, options, str(args.trace),
                                on_request=lambda: bar.advance(task))
    finally:
        t_remove = time.perf_counter()
        remove_tree(root)
        remove_s = time.perf_counter() - t_remove
    command_s = time.perf_counter() - t_command
    figures = {"trace": str(args.trace), "requests": report.requests,
               "wall_s": report.wall_s, "target_wall_s": TARGET_WALL_S,
               "wall_vs_target": report.wall_s / TARGET_WALL_S,
               "remove_s": remove_s, "command_s": command_s,
               "command_vs_target": command_s / TARGET_WALL_S,
               "manager_us_per_chunk": report.manager_us_per_chunk,
               "worker_us_per_chunk": report.worker_us_per_chunk,
               "chunks_moved": report.chunks_moved, "verified_chunks": report.verified_chunks,
               "hit_tokens": report.hit_tokens, "hit_ratio": report.hit_ratio,
               "reference_hit_ratio": reference.hit_ratio}
    if args.json:
        print_json(figures)
    else:
        print_table("kvhal bench replay — host 2 GiB, fs 8 GiB, 32 KiB chunks, verified",
                    ["metric", "value"], [[k, f"{v:.4g}" if isinstance(v, float) else str(v)]
                                          for k, v in figures.items()])
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `kvhal bench replay`."""
    p = sub.add_parser("replay", help="replay a trace through host 2 GiB + fs 8 GiB against the "
                                      "5-minute target")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE,
                   help=f"trace to replay (default: {DEFAULT_TRACE})")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--tmp-dir", default=None, help="folder for the fs tier's temporary root")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
