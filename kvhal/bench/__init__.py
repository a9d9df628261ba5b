"""`kvhal bench <what>`: benchmarks that print ratios measured side by side in one run.

Each benchmark module exposes `register(subparsers)`.
"""
from __future__ import annotations

import argparse
import importlib

#: Modules that each contribute one `kvhal bench` sub-verb.
BENCH_MODULES = (
    "kvhal.bench.copy",
    "kvhal.bench.tier",
    "kvhal.bench.layout",
    "kvhal.bench.copy_kernel",
    "kvhal.bench.copy2d",
    "kvhal.bench.engine",
    "kvhal.bench.p2p",
    "kvhal.integrations.harness.bench",
    "kvhal.integrations.vllm.bench",
    "kvhal.integrations.vllm.bench_serve",
)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `bench` verb and its sub-verbs."""
    p = sub.add_parser("bench", help="benchmarks (ratios against a baseline in the same run)")
    bench_sub = p.add_subparsers(dest="bench", required=True, metavar="WHAT")
    for name in BENCH_MODULES:
        importlib.import_module(name).register(bench_sub)
