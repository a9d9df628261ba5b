"""`kvhal bench layout`: cost of planning one chunk's copies vs copying its bytes.

For Llama-3.1-8B geometry (32 layers, 8 KV heads, head size 128, bf16, 16-token blocks), per
attention layout × TP size × blocks per chunk: the best-of-`--repeats` time of one
`plan_copies` (D2H, rank 0, a full chunk of scattered block ids, mapper prebuilt as the worker
does; "flat" = every run expanded into batch descriptors, `expand_up_to` large) and, in the
same run, of one `np.copyto` of that chunk's bytes on this rank (host memcpy,
the floor of the transfer the plan drives). The ratio is plan time / memcpy time.
"""
from __future__ import annotations

import argparse

import numpy as np

from kvhal.argtypes import positive_int
from kvhal.integrations.harness.bench.copy import _best_seconds
from kvhal.layout import D2H, DeviceCache, attention_spec, chunk_mapper, plan_copies
from kvhal.report import print_json, print_table

SPEC = attention_spec(num_layers=32, num_kv_heads=8, head_size=128, dtype="bf16",
                      block_size=16)
LAYOUTS = ("packed-hnd", "packed-nhd", "split-nhd", "split-hnd", "separate-kv", "vllm-cpu")
NUM_BLOCKS = 4096


def measure(layout: str, tp: int, blocks_per_chunk: int, repeats: int) -> dict:
    """One row: runs, plan µs, memcpy µs and their ratio (see module docstring)."""
    mapper = chunk_mapper(SPEC, layout, tp, 0, blocks_per_chunk)
    page = mapper.groups[0].page_bytes
    planes = mapper.groups[0].layout.num_planes
    layers = SPEC.num_layers
    device = DeviceCache(np.arange(layers, dtype=np.uint64) * np.uint64(NUM_BLOCKS * page)
                         + np.uint64(1 << 40), np.full(layers, page // planes, np.int64),
                         np.full(layers, NUM_BLOCKS * page // 2 if planes == 2 else 0,
                                 np.int64), NUM_BLOCKS)
    ids = np.random.default_rng(0).permutation(NUM_BLOCKS)[:blocks_per_chunk]
    plan = plan_copies(mapper, ids, device, 1 << 44, D2H)
    flat = plan_copies(mapper, ids, device, 1 << 44, D2H, expand_up_to=1 << 30)
    plan_s = _best_seconds(lambda: plan_copies(mapper, ids, device, 1 << 44, D2H), repeats)
    flat_s = _best_seconds(lambda: plan_copies(mapper, ids, device, 1 << 44, D2H,
                                               expand_up_to=1 << 30), repeats)
    src = np.ones(mapper.device_block_bytes * blocks_per_chunk, np.uint8)
    dst = np.empty_like(src)
    copy_s = _best_seconds(lambda: np.copyto(dst, src), repeats)
    return {"layout": layout, "tp": tp, "blocks_per_chunk": blocks_per_chunk,
            "runs": mapper.runs_per_chunk(D2H), "copies_2d": len(plan.copies_2d),
            "batch": int(plan.sizes.size), "plan_us": plan_s * 1e6,
            "flat_batch": int(flat.sizes.size), "flat_plan_us": flat_s * 1e6,
            "memcpy_us": copy_s * 1e6, "ratio": plan_s / copy_s}


def run(args: argparse.Namespace) -> int:
    """Print one row per layout × TP × blocks per chunk."""
    rows = [measure(lay, tp, n, args.repeats) for lay in LAYOUTS for tp in args.tp
            for n in args.blocks_per_chunk]
    if args.json:
        print_json({"results": rows})
        return 0
    print_table("plan_copies per chunk vs memcpy of its bytes (Llama-3.1-8B, rank 0, D2H)",
                ["layout", "tp", "N", "runs", "2D", "batch", "plan µs", "flat batch",
                 "flat plan µs", "memcpy µs", "ratio"],
                [list(r.values()) for r in rows])
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `bench layout`."""
    p = sub.add_parser("layout", help="plan_copies cost per chunk vs memcpy of the chunk")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 8], help="TP sizes")
    p.add_argument("--blocks-per-chunk", type=int, nargs="+", default=[1, 16],
                   help="blocks per chunk")
    p.add_argument("--repeats", type=positive_int, default=50, help="timed passes (best is kept)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
