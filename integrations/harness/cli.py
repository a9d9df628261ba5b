"""`kvhal replay TRACE`: replay a trace through the real engine and tiers, report hits by tier.

See `kvhal replay --help`; the engine run itself is `replay.run_replay`.
"""
from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Any

from kvhal.argtypes import json_object, non_negative_float, positive_int
from kvhal.layout import ELEMENT_BYTES
from kvhal.report import progress

from .geometry import DEEPSEEK_LATENT, PRESETS, Geometry, MlaGeometry, preset
from .plot import check_plot_path, plot_sweep, plot_timeline
from .reference import reference_hits
from .replay import DEFAULT_CONFIG, ReplayOptions, check_replay, run_replay, with_capacity
from .report import DEFAULT_PREFILL_US_PER_TOKEN, print_report, print_sweep
from .trace import FORMATS, MOONCAKE_BLOCK_TOKENS, read_trace

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """A byte size: "512", "32K", "1.5G", "2GiB" (binary units).

    Raises:
        argparse.ArgumentTypeError: not a size, or not positive.
    """
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 512M, 2G, 1.5GiB)")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"byte size must be positive, got {text!r}")
    return value


def parse_sweep(text: str) -> tuple[str, list[int]]:
    """`LEVEL=SIZE,SIZE,...` (LEVEL: device, host, or a secondary tier type) → (level, sizes)."""
    level, sep, sizes = text.partition("=")
    if not sep or not level or not sizes:
        raise argparse.ArgumentTypeError(f"--sweep must look like host=1G,2G,4G, got {text!r}")
    return level.strip(), [parse_bytes(s) for s in sizes.split(",")]


def load_config(text: str | None) -> dict[str, Any]:
    """The engine config: inline JSON (starting with "{"), a path to a JSON file, or None for
    `DEFAULT_CONFIG`.

    Raises:
        ValueError: unreadable file or invalid JSON (names the source).
    """
    if text is None:
        return dict(DEFAULT_CONFIG)
    source = "--config"
    if not text.lstrip().startswith("{"):
        source = text
        try:
            text = Path(text).read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{source}: not UTF-8 text (byte {exc.start})") from None
    return json_object(text, source)


def _geometry(args: argparse.Namespace) -> Geometry | MlaGeometry:
    """The geometry the flags describe (see `register`).

    Raises:
        ValueError: flags that exclude each other, or `--latent-size` without `--mla` (names
            both flags).
        GeometryError: a value `kvhal.layout` refuses (names its flag).
    """
    full = [n for n in ("kv_heads", "head_size") if getattr(args, n) is not None]
    explicit = [n for n in ("mla", "latent_size", "layers", "dtype")
                if getattr(args, n) not in (None, False)] + full
    if args.preset and explicit:
        raise ValueError(f"--preset and --{explicit[0].replace('_', '-')} exclude each other")
    if args.latent_size is not None and not args.mla:
        raise ValueError("--latent-size needs --mla (a full-attention geometry has --kv-heads "
                         "and --head-size)")
    if args.mla:
        if full:
            raise ValueError(f"--mla and --{full[0].replace('_', '-')} exclude each other (an "
                             "MLA layer holds one latent per token: --latent-size)")
        return MlaGeometry(args.layers or 1, args.latent_size or DEEPSEEK_LATENT,
                           args.dtype or "bfloat16")
    if explicit:
        base = PRESETS["tiny"]
        return Geometry(args.layers or base.layers, args.kv_heads or base.kv_heads,
                        args.head_size or base.head_size, args.dtype or base.dtype)
    return preset(args.preset or "tiny")


def _check_device_pools(device_bytes: int, tp: int, instances: int) -> None:
    """Refuse device pools (one of `device_bytes` per TP rank and instance) larger than this
    machine's physical memory, before anything is allocated.

    Raises:
        ValueError: names --device-bytes, --tp and --instances with the bytes needed.
    """
    total = device_bytes * tp * instances
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if total > physical:
        raise ValueError(f"--device-bytes {device_bytes} × --tp {tp} × --instances {instances} "
                         f"= {total} bytes of device pools, more than this machine's "
                         f"{physical} bytes of memory")


def run(args: argparse.Namespace) -> int:
    """Read the trace, replay it (once, or once per swept capacity), print and plot."""
    chunk_tokens = args.chunk_tokens
    requests = read_trace(args.trace, fmt=args.format, chunk_tokens=chunk_tokens,
                          limit=args.limit)
    if not requests:
        raise ValueError(f"{args.trace}: no requests to replay (empty trace)")
    if args.plot:
        check_plot_path(args.plot)
    _check_device_pools(args.device_bytes, args.tp, args.instances)
    reference = reference_hits(requests, chunk_tokens)
    config = load_config(args.config)
    options = ReplayOptions(geometry=_geometry(args), chunk_tokens=chunk_tokens,
                            device_bytes=args.device_bytes, backend=args.backend,
                            prefill_us_per_token=args.prefill_us_per_token,
                            time_scale=args.time_scale, layout=args.layout,
                            instances=args.instances, tp=args.tp)
    runs = ([(config, options)] if args.sweep is None else
            [with_capacity(config, options, args.sweep[0], size) for size in args.sweep[1]])
    for cfg, opts in runs:
        check_replay(requests, cfg, opts)
    reports = []
    with progress(disable=args.json) as bar:
        for i, (cfg, opts) in enumerate(runs):
            task = bar.add_task(f"replay {i + 1}/{len(runs)}", total=len(requests))
            reports.append(run_replay(requests, reference, cfg, opts, str(args.trace),
                                      on_request=lambda: bar.advance(task)))
            bar.remove_task(task)
    if args.sweep is None:
        print_report(reports[0], args.json)
        if args.plot:
            t = reports[0].timeline
            plot_timeline(args.plot, t.time_s, t.input_tokens, t.hit_tokens, t.ttft_saved_s,
                          f"kvhal replay — {Path(args.trace).name}")
    else:
        what = args.sweep[0]
        print_sweep(what, reports, args.json)
        if args.plot:
            plot_sweep(args.plot, what, args.sweep[1], [r.hit_ratio for r in reports],
                       reference.hit_ratio, f"kvhal replay — {Path(args.trace).name}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `kvhal replay`."""
    p = sub.add_parser("replay", help="replay a request trace through the real engine and tiers",
                       description=__doc__.splitlines()[0])
    p.add_argument("trace", type=Path, help="Mooncake JSONL or token-id JSONL trace")
    p.add_argument("--format", choices=FORMATS, default="auto", help="trace format")
    p.add_argument("--chunk-tokens", type=positive_int, default=MOONCAKE_BLOCK_TOKENS,
                   help="tokens per chunk of a token-id trace (Mooncake: 512, fixed)")
    p.add_argument("--config", default=None,
                   help="engine config: JSON text or a JSON file (default: "
                        f"{json.dumps(DEFAULT_CONFIG)})")
    p.add_argument("--device-bytes", type=parse_bytes, default=parse_bytes("1G"),
                   help="device KV pool standing in for accelerator memory (default 1G)")
    p.add_argument("--backend", default="cpu", help="device HAL backend (default cpu)")
    g = p.add_argument_group("model geometry (default: --preset tiny, 64 B/token)")
    g.add_argument("--preset", choices=sorted(PRESETS), default=None)
    g.add_argument("--layers", type=positive_int, default=None)
    g.add_argument("--kv-heads", type=positive_int, default=None)
    g.add_argument("--head-size", type=positive_int, default=None)
    g.add_argument("--dtype", choices=sorted(ELEMENT_BYTES), default=None)
    g.add_argument("--mla", action="store_true",
                   help="MLA geometry: --layers (default 1) × --latent-size × --dtype "
                        "(default bfloat16), the same latent page on every TP rank")
    g.add_argument("--latent-size", type=positive_int, default=None,
                   help=f"MLA latent elements per token (default {DEEPSEEK_LATENT}: "
                        "DeepSeek-V2/V3's kv_lora_rank 512 + qk_rope_head_dim 64)")
    g.add_argument("--tp", type=positive_int, default=1,
                   help="TP ranks, MLA only: rank 0 stores each chunk, every rank loads it and "
                        "is verified (default 1)")
    g.add_argument("--layout", default=None,
                   help="device layout of the per-layer KV tensors, a registered layout "
                        "(full attention: packed-hnd default, packed-nhd, split-nhd, "
                        "split-hnd, separate-kv, vllm-cpu; MLA: mla; or a plugin's)")
    p.add_argument("--prefill-us-per-token", type=non_negative_float,
                   default=DEFAULT_PREFILL_US_PER_TOKEN,
                   help="modeled prefill cost (default 32.5: Llama-3.1-8B on one H100 at 50%% "
                        "MFU; derivation in kvhal.integrations.harness.report)")
    p.add_argument("--time-scale", type=non_negative_float, default=0.0,
                   help="replay on the trace's timestamps multiplied by this (1 = the "
                        "trace's pace, 0 = as fast as possible, default)")
    p.add_argument("--instances", type=positive_int, default=1,
                   help="serving instances to split the requests between (round robin), each "
                        "with its own device pool, host tier and tiers; p2p tiers of the "
                        "config are wired to each other (default 1)")
    p.add_argument("--limit", type=positive_int, default=None,
                   help="replay only the first N requests")
    p.add_argument("--sweep", type=parse_sweep, default=None,
                   help="replay once per capacity, e.g. host=1G,2G,4G (device, host or a "
                        "secondary tier type)")
    p.add_argument("--plot", default=None, help="write a PNG: hit ratio and TTFT saved over "
                                                "time (or hit ratio vs capacity with --sweep)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
