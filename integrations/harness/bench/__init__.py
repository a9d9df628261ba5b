"""`kvhal bench <what>`: benchmarks that print ratios measured side by side in one run.

Each benchmark module exposes `register(subparsers)`.
"""
from __future__ import annotations

import argparse
import importlib

#: Modules that each contribute one `kvhal bench` sub-verb.
BENCH_MODULES = (
    "kvhal.integrations.harness.bench.copy",
    "kvhal.integrations.harness.bench.tier",
    "kvhal.integrations.harness.bench.layout",
    "kvhal.integrations.harness.bench.copy_kernel",
    "kvhal.integrations.harness.bench.copy2d",
    "kvhal.integrations.harness.bench.engine",
    "kvhal.integrations.harness.bench.p2p",
    "kvhal.integrations.harness.bench.replay",
    "kvhal.integrations.harness.bench.vllm",
    "kvhal.integrations.harness.bench.vllm_link",
    "kvhal.integrations.harness.bench.serve",
    "kvhal.integrations.harness.bench.fleet",
)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `bench` verb and its sub-verbs."""
    p = sub.add_parser("bench", help="benchmarks (ratios against a baseline in the same run)")
    bench_sub = p.add_subparsers(dest="bench", required=True, metavar="WHAT")
    for name in BENCH_MODULES:
        importlib.import_module(name).register(bench_sub)
