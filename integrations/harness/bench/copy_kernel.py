"""`kvhal bench copy-kernel`: DMA batch copies vs the backend's copy kernel, side by side.

For each block size it runs `kvhal bench copy`'s measurement twice in one process: once with
`copy_batch_async` (DMA: the runtime's batch call or per-copy loop) and once with the same
blocks routed through `copy_batch_kernel_async` (a gather/scatter kernel, e.g. the cuda
backend's NVRTC kernel). Ratios are kernel / DMA throughput.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from kvhal.plugins import select_backend
from kvhal.report import print_json, print_table, progress

from . import copy
from .copy import _human, measure


class KernelBatch:
    """A view of `backend` whose `copy_batch_async` is its `copy_batch_kernel_async`."""

    def __init__(self, backend: Any):
        self._backend = backend

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def copy_batch_async(self, dsts, srcs, sizes, stream) -> None:
        """Route the batch through the copy kernel."""
        self._backend.copy_batch_kernel_async(dsts, srcs, sizes, stream)


def run(args: argparse.Namespace) -> int:
    """Measure DMA and kernel for every block size and print the table (or JSON)."""
    backend = select_backend(args.backend)
    if not hasattr(backend, "copy_batch_kernel_async"):
        print(f"kvhal bench copy-kernel: backend {backend.name} has no copy kernel",
              file=sys.stderr)
        return 2
    rows = []
    with progress(disable=args.json) as bar:
        task = bar.add_task(f"bench copy-kernel [{backend.name}]", total=len(args.sizes))
        for size in args.sizes:
            dma = measure(backend, size, repeats=args.repeats)
            kernel = measure(KernelBatch(backend), size, repeats=args.repeats)
            rows.append({"block_bytes": size, "blocks": dma.blocks,
                         **{f"dma_{d}_gbps": getattr(dma, f"{d}_gbps")
                            for d in ("d2h", "h2d", "bidir")},
                         **{f"kernel_{d}_gbps": getattr(kernel, f"{d}_gbps")
                            for d in ("d2h", "h2d", "bidir")}})
            bar.advance(task)
    for row in rows:
        for d in ("d2h", "h2d", "bidir"):
            row[f"kernel_vs_dma_{d}"] = row[f"kernel_{d}_gbps"] / row[f"dma_{d}_gbps"]
    if args.json:
        print_json({"backend": backend.name, "results": rows})
        return 0
    print_table(f"kvhal bench copy-kernel — backend {backend.name} (GB/s; kernel ÷ DMA)",
                ["block", "blocks", "D2H dma", "D2H kernel", "H2D dma", "H2D kernel",
                 "bidir dma", "bidir kernel", "D2H ×", "H2D ×", "bidir ×"],
                [[_human(r["block_bytes"]), r["blocks"]]
                 + [round(r[f"{k}_{d}_gbps"], 2) for d in ("d2h", "h2d", "bidir")
                    for k in ("dma", "kernel")]
                 + [round(r[f"kernel_vs_dma_{d}"], 2) for d in ("d2h", "h2d", "bidir")]
                 for r in rows])
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `kvhal bench copy-kernel`, with exactly `kvhal bench copy`'s options."""
    scratch = argparse.ArgumentParser(add_help=False).add_subparsers()
    copy.register(scratch)
    p = sub.add_parser("copy-kernel", parents=[scratch.choices["copy"]],
                       conflict_handler="resolve",
                       help="DMA batch copies vs the backend's copy kernel")
    p.set_defaults(func=run)
