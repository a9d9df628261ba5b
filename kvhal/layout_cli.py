"""`kvhal layout`: per TP rank, the device bytes per block, the canonical chunk bytes and the
copy runs of one model geometry and device layout (DESIGN §3); for a hybrid geometry (extra
sliding-window or Mamba layers: one KV cache group each) also each group's chunk and host slot
bytes, and with --cpu-bytes the host pool of each group (`kvhal.host.host_layout`: slots after
the group's `state_slot_share`, bytes) and the bytes of the budget left unallocated."""
from __future__ import annotations

import argparse

from .config import DEFAULT_STATE_SLOT_SHARE, ConfigError, EngineConfig, parse_config
from .host import host_geometry, host_layout
from .layout import (D2H, FORMAT_ID, H2D, Kind, KVCacheSpec, LayerGroup, attention_spec,
                     canonical_page_bytes, chunk_mapper, default_layouts, mla_spec)
from .report import print_json, print_table

MIB = 1 << 20


def collect(args: argparse.Namespace) -> dict:
    """The report as a dict: geometry, format, and one row per TP rank.

    Raises:
        LayoutError: an impossible geometry or an unmappable layout (names field or layer).
        ValueError: --tp below 1, heads missing without --mla-latent, or heads given with it;
            a bad --cpu-bytes or --state-slot-share (named by its flag).
    """
    if args.tp < 1:
        raise ValueError(f"--tp: must be a positive int, got {args.tp}")
    if args.mla_latent is not None:
        if args.kv_heads is not None or args.head_size is not None:
            raise ValueError("--kv-heads and --head-size do not apply with --mla-latent (an MLA "
                             "layer stores one latent per token, shared by all heads)")
        spec = mla_spec(num_layers=args.layers, latent_size=args.mla_latent, dtype=args.dtype,
                        block_size=args.block_size, extra_bytes_per_token=args.extra_bytes)
    else:
        if args.kv_heads is None or args.head_size is None:
            raise ValueError("--kv-heads and --head-size are required without --mla-latent")
        spec = attention_spec(num_layers=args.layers, num_kv_heads=args.kv_heads,
                              head_size=args.head_size, dtype=args.dtype,
                              block_size=args.block_size, extra_bytes_per_token=args.extra_bytes)
    spec = _with_hybrid_groups(spec, args)
    layouts = default_layouts(spec.groups, args.attention)
    ranks = []
    for rank in range(args.tp):
        m = chunk_mapper(spec, layouts, args.tp, rank, args.blocks_per_chunk)
        ranks.append({
            "rank": rank,
            "writer": all(g.share.writer for g in m.groups),
            "device_block_bytes": m.device_block_bytes,
            "device_block_mib": m.device_block_bytes / MIB,
            "canonical_chunk_bytes": m.chunk.chunk_bytes,
            "runs_per_page": [len(g.runs) for g in m.groups],
            "store_runs_per_chunk": m.runs_per_chunk(D2H),
            "load_runs_per_chunk": m.runs_per_chunk(H2D),
            "copies_2d_per_chunk": m.copies_2d_per_chunk(H2D),
        })
    chunks = [g.num_layers * canonical_page_bytes(g, args.blocks_per_chunk) for g in spec.groups]
    host = {}
    pools = None
    if args.cpu_bytes is not None:
        config = _config(args)
        shares = config.slot_shares(g.kind for g in spec.groups)
        layout = host_layout(tuple(chunks), args.cpu_bytes, shares)
        pools = layout.pools
        host = {"cpu_bytes": args.cpu_bytes, "host_bytes": layout.nbytes,
                "unused_bytes": args.cpu_bytes - layout.nbytes}
    groups = [{"group": i, "kind": g.kind.value, "layers": g.num_layers, "chunk_bytes": n,
               "slot_bytes": host_geometry(n, 1 << 62).slot_bytes,
               **({"share": shares[i], "slots": pools[i].capacity,
                   "host_bytes": pools[i].nbytes} if pools else {})}
              for i, (g, n) in enumerate(zip(spec.groups, chunks))]
    return {"format_id": FORMAT_ID, "layouts": list(layouts), "tp": args.tp,
            "blocks_per_chunk": args.blocks_per_chunk, "ranks": ranks, "groups": groups, **host}


#: The config key each host-pool flag stands for (errors name the flag).
_FLAGS = {"cpu_bytes_to_use": "--cpu-bytes", "state_slot_share": "--state-slot-share"}


def _config(args: argparse.Namespace) -> EngineConfig:
    """The engine config of --cpu-bytes and --state-slot-share.

    Raises:
        ValueError: a bad value, named by its flag (`--cpu-bytes: must be an integer ≥ 1...`).
    """
    try:
        return parse_config({key: getattr(args, flag[2:].replace("-", "_"))
                             for key, flag in _FLAGS.items()})
    except ConfigError as exc:
        raise ValueError(f"{_FLAGS.get(exc.path, exc.path)}{str(exc)[len(exc.path):]}") from None


def _with_hybrid_groups(spec: KVCacheSpec, args: argparse.Namespace) -> KVCacheSpec:
    """`spec` plus a sliding-window group (--sliding-layers, same heads as the attention
    layers) and a Mamba group (--mamba-layers), each a KV cache group of its own.

    Raises:
        ValueError: a hybrid option without its companion (window, state bytes), or sliding
            layers on an MLA model.
    """
    groups = list(spec.groups)
    base = groups[0]
    if args.sliding_layers:
        if args.sliding_window is None or base.kind is Kind.MLA:
            raise ValueError("--sliding-layers needs --sliding-window and attention layers "
                             "(--kv-heads/--head-size)")
        groups.append(LayerGroup(Kind.SLIDING_WINDOW, args.sliding_layers, base.num_kv_heads,
                                 base.head_size, base.dtype, base.block_size,
                                 base.extra_bytes_per_token, args.sliding_window))
    if args.mamba_layers:
        if args.mamba_state_bytes is None:
            raise ValueError("--mamba-layers needs --mamba-state-bytes")
        groups.append(LayerGroup(Kind.MAMBA, args.mamba_layers, 1, 0, base.dtype,
                                 base.block_size, state_bytes=args.mamba_state_bytes))
    return KVCacheSpec(tuple(groups))


def run(args: argparse.Namespace) -> int:
    """Print the per-rank table (or JSON)."""
    report = collect(args)
    if args.json:
        print_json(report)
        return 0
    rows = [[r["rank"], "yes" if r["writer"] else "no", r["device_block_bytes"],
             f"{r['device_block_mib']:.3f}", r["canonical_chunk_bytes"],
             "/".join(map(str, r["runs_per_page"])), r["store_runs_per_chunk"],
             r["load_runs_per_chunk"], r["copies_2d_per_chunk"]] for r in report["ranks"]]
    if len(report["groups"]) > 1 or "slots" in report["groups"][0]:
        cols = ["group", "kind", "layers", "chunk_bytes", "slot_bytes", "share", "slots",
                "host_bytes"]
        unused = (f" of {report['cpu_bytes']} ({report['unused_bytes']} unused)"
                  if "cpu_bytes" in report else "")
        print_table("KV cache groups: canonical bytes per chunk, host slot bytes (rounded to "
                    "the page), host pool (with --cpu-bytes): relative slot count, slots, "
                    f"bytes{unused}", cols,
                    [[g.get(c, "") for c in cols] for g in report["groups"]])
    print_table(f"{report['format_id']} · {', '.join(report['layouts'])} · TP {report['tp']} · "
                f"{report['blocks_per_chunk']} blocks/chunk · per rank: device bytes per block "
                "(all layers), canonical bytes per chunk, copy runs per layer page and per "
                "chunk (D2H = store, H2D = load), 2D copies per chunk",
                ["rank", "writes", "B/block", "MiB", "B/chunk", "runs/page", "D2H runs",
                 "H2D runs", "2D"], rows)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `layout` verb."""
    p = sub.add_parser("layout", help="device page and canonical chunk sizes and copy runs")
    p.add_argument("--layers", type=int, required=True, help="number of layers")
    p.add_argument("--kv-heads", type=int, help="total KV heads (TP = 1)")
    p.add_argument("--head-size", type=int, help="head size in elements")
    p.add_argument("--dtype", default="bf16", help="KV dtype (bf16, fp16, fp32, fp8, ...)")
    p.add_argument("--block-size", type=int, required=True, help="tokens per device block")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--blocks-per-chunk", type=int, default=1, help="device blocks per chunk")
    p.add_argument("--attention", default="packed-hnd",
                   help="device layout of attention layers (see kvhal.layout.devices)")
    p.add_argument("--mla-latent", type=int, help="MLA latent size in elements (MLA model)")
    p.add_argument("--extra-bytes", type=int, default=0,
                   help="extra bytes per token per KV head (e.g. fp8 scales)")
    p.add_argument("--sliding-layers", type=int, default=0,
                   help="hybrid: extra sliding-window attention layers (their own group)")
    p.add_argument("--sliding-window", type=int, help="window of --sliding-layers, tokens")
    p.add_argument("--mamba-layers", type=int, default=0,
                   help="hybrid: extra Mamba/linear-attention state layers (their own group)")
    p.add_argument("--mamba-state-bytes", type=int, help="state bytes per --mamba-layers layer")
    p.add_argument("--cpu-bytes", type=int, help="host budget: print each group's host pool")
    p.add_argument("--state-slot-share", type=float, default=DEFAULT_STATE_SLOT_SHARE,
                   help="host slots of a state group per attention slot, in (0, 1] (the "
                        f"config's state_slot_share; default {DEFAULT_STATE_SLOT_SHARE})")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
