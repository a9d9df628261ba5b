"""What a replay reports, as a value (`ReplayReport`), a human table, or JSON.

Units: tokens, bytes, seconds; GB/s is 1e9 bytes per second.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvhal.report import print_json, print_table

from .reference import ReferenceResult

#: Default prefill cost, µs per prompt token: Llama-3.1-8B (8.03e9 parameters, Meta model card)
#: costs ≈ 2 FLOPs per parameter per token in a forward pass (Kaplan et al. 2020, "Scaling Laws
#: for Neural Language Models", §2.1), on one H100 SXM (989.4 TFLOP/s dense BF16, NVIDIA H100
#: datasheet) at an assumed 50 % model FLOPs utilisation: 2 × 8.03e9 / (0.5 × 989.4e12) s =
#: 32.5 µs. Attention's quadratic term is ignored, so long prompts cost more than this.
DEFAULT_PREFILL_US_PER_TOKEN = 32.5


@dataclass(frozen=True, slots=True)
class TierTraffic:
    """Bytes and chunks moved in one direction of one tier (host: D2H/H2D with the device;
    secondary: store = host → tier, load = tier → host)."""

    chunks: int = 0
    nbytes: int = 0


@dataclass(frozen=True, slots=True)
class Timeline:
    """Per-request samples for `--plot`, each an array of shape (requests,).

    Attributes:
        time_s: float64, trace timestamp in seconds.
        input_tokens, hit_tokens: int64.
        ttft_saved_s: float64, modeled TTFT saved (see `ReplayReport.ttft_saved_s`).
    """

    time_s: np.ndarray
    input_tokens: np.ndarray
    hit_tokens: np.ndarray
    ttft_saved_s: np.ndarray


@dataclass(frozen=True, slots=True)
class ReplayReport:
    """Outcome of one replay.

    Attributes:
        trace: Path of the trace file.
        capacities: Bytes of each cache level as configured: "device", "host", and one entry per
            secondary tier ("fs", ...; None = unbounded/tier default).
        chunk_tokens, chunk_bytes: Tokens and canonical bytes of one chunk.
        requests, input_tokens: Totals over the replayed requests.
        hit_tokens: Tokens served from each level: "device" (the device pool's prefix cache),
            "host", then each secondary tier by name; only full chunks hit.
        traffic: Per level and direction ("host": "d2h", "h2d"; a secondary: "store", "load").
        reference: The unlimited-capacity reference on the same requests.
        wall_s: Wall time of the replay (reading and reference excluded).
        manager_s: Time spent inside manager calls (bookkeeping; includes secondary-tier
            lookups and job submission, excludes the final drain), seconds.
        worker_s: Time spent inside worker calls issuing and collecting D2H/H2D jobs (planning,
            HAL calls, events; excludes waiting for copies), seconds.
        load_s: Measured wall time of the H2D loads, including waits on tier promotions.
        verified_chunks: Loaded chunks whose bytes were checked (all of them).
        prefill_us_per_token: The modeled prefill cost.
        ttft_saved_s: Σ over requests of (hit tokens × prefill cost − that request's load time).
        timeline: Per-request samples, or None when not recorded.
        instances: Serving instances the requests were split between (capacities are per
            instance; hits, traffic and times are totals over them).
        tp: TP ranks per instance (the device capacity is per rank; host traffic counts each
            chunk's host slot once).
        geometry: The model geometry (`Geometry.as_dict` / `MlaGeometry.as_dict`) and its
            device "layout".
        rank_bytes: Per TP rank, the bytes its workers copied ("d2h", "h2d"; totals over
            instances); an MLA chunk is written by rank 0 only and read by every rank.
    """

    trace: str
    capacities: dict[str, int | None]
    chunk_tokens: int
    chunk_bytes: int
    requests: int
    input_tokens: int
    hit_tokens: dict[str, int]
    traffic: dict[str, dict[str, TierTraffic]]
    reference: ReferenceResult
    wall_s: float
    manager_s: float
    worker_s: float
    load_s: float
    verified_chunks: int
    prefill_us_per_token: float
    ttft_saved_s: float
    timeline: Timeline | None = field(default=None, repr=False)
    instances: int = 1
    tp: int = 1
    geometry: dict[str, Any] = field(default_factory=dict)
    rank_bytes: list[dict[str, int]] = field(default_factory=list)

    @property
    def total_hit_tokens(self) -> int:
        """Hit tokens over all levels."""
        return sum(self.hit_tokens.values())

    @property
    def hit_ratio(self) -> float:
        """total_hit_tokens / input_tokens (0.0 for an empty trace)."""
        return self.total_hit_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def chunks_moved(self) -> int:
        """Chunks moved between device and host (both directions)."""
        return sum(t.chunks for t in self.traffic.get("host", {}).values())

    @property
    def manager_us_per_chunk(self) -> float:
        """Manager time per chunk moved between device and host, µs."""
        return self.manager_s / self.chunks_moved * 1e6 if self.chunks_moved else 0.0

    @property
    def worker_us_per_chunk(self) -> float:
        """Worker time (issuing and collecting copies) per chunk moved, µs."""
        return self.worker_s / self.chunks_moved * 1e6 if self.chunks_moved else 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready dict: every field (timeline dropped), derived figures, reference ratio."""
        out = {k: v for k, v in asdict(self).items() if k != "timeline"}
        out["reference"] = asdict(self.reference) | {"hit_ratio": self.reference.hit_ratio}
        moved_bytes = sum(t.nbytes for t in self.traffic.get("host", {}).values())
        out |= {"total_hit_tokens": self.total_hit_tokens, "hit_ratio": self.hit_ratio,
                "chunks_per_s": self.chunks_moved / self.wall_s if self.wall_s else 0.0,
                "gb_per_s": moved_bytes / self.wall_s / 1e9 if self.wall_s else 0.0,
                "manager_us_per_chunk": self.manager_us_per_chunk,
                "worker_us_per_chunk": self.worker_us_per_chunk}
        return out


def _gib(nbytes: int | None) -> str:
    if nbytes is None:
        return "default"
    return (f"{nbytes / (1 << 30):.3g} GiB" if nbytes >= 1 << 30 else
            f"{nbytes / (1 << 20):.3g} MiB")


def _geometry(report: ReplayReport) -> str:
    """One line: "mla: 2 layers × 576 bfloat16, layout mla, TP 2" (or the full-attention
    fields)."""
    g = report.geometry
    if not g:
        return "-"
    shape = (f"{g['layers']} layers × {g['latent_size']}" if g["kind"] == "mla" else
             f"{g['layers']} layers × {g['kv_heads']} KV heads × {g['head_size']}")
    return f"{g['kind']}: {shape} {g['dtype']}, layout {g['layout']}, TP {report.tp}"


def print_report(report: ReplayReport, as_json: bool) -> None:
    """Print one report as tables (or JSON)."""
    d = report.as_dict()
    if as_json:
        print_json(d)
        return
    ref = report.reference
    print_table(f"kvhal replay — {report.trace}", ["metric", "value"], [
        ["requests", report.requests if report.instances == 1 else
         f"{report.requests}, split between {report.instances} instances"],
        ["input tokens", report.input_tokens],
        ["hit tokens", report.total_hit_tokens],
        ["hit ratio", f"{report.hit_ratio:.4f}"],
        ["reference ratio (unlimited capacity)", f"{ref.hit_ratio:.4f} ({ref.hit_tokens} "
                                                 f"tokens, {ref.distinct_chunks} chunks)"],
        ["geometry", _geometry(report)],
        ["chunk", f"{report.chunk_tokens} tokens, {report.chunk_bytes} bytes"],
        ["modeled TTFT saved", f"{report.ttft_saved_s:.1f} s at "
                               f"{report.prefill_us_per_token} µs/token prefill"],
        ["measured load time", f"{report.load_s:.2f} s"],
        ["verified hit chunks", f"{report.verified_chunks}" + (
            f", each on all {report.tp} TP ranks" if report.tp > 1 else "")
         + " (0 mismatches: a mismatch fails the run)"],
        *([["bytes copied per TP rank (D2H / H2D)", ", ".join(
            f"rank {k}: {b['d2h']} / {b['h2d']}" for k, b in enumerate(report.rank_bytes))]]
          if report.tp > 1 else []),
        ["wall time", f"{report.wall_s:.1f} s"],
        ["throughput (device↔host)", f"{d['chunks_per_s']:.0f} chunks/s, "
                                     f"{d['gb_per_s']:.2f} GB/s"],
        ["engine time per chunk moved", f"manager {report.manager_us_per_chunk:.1f} µs, "
                                        f"worker {report.worker_us_per_chunk:.1f} µs"]])
    rows = []
    for level, tokens in report.hit_tokens.items():
        traffic = report.traffic.get(level, {})
        moved = [traffic.get(k) for k in (("d2h", "h2d") if level == "host" else
                                          ("store", "load"))]
        rows.append([level, _gib(report.capacities.get(level)), tokens,
                     f"{tokens / report.input_tokens if report.input_tokens else 0:.4f}",
                     *(f"{t.chunks} / {t.nbytes / 1e9:.3f} GB" if t else "-" for t in moved)])
    print_table("hits and traffic by level (host: written = D2H, read = H2D)",
                ["level", "capacity", "hit tokens", "share of input", "written (chunks / bytes)",
                 "read (chunks / bytes)"], rows)


def print_sweep(what: str, reports: list[ReplayReport], as_json: bool) -> None:
    """Print one row per swept capacity of `what` (or JSON with every report)."""
    if as_json:
        print_json({"sweep": what, "reports": [r.as_dict() for r in reports]})
        return
    print_table(f"kvhal replay — sweep of {what} capacity",
                [f"{what} capacity", "hit ratio", "reference ratio", "TTFT saved (s)",
                 "wall (s)"],
                [[_gib(r.capacities.get(what)), f"{r.hit_ratio:.4f}",
                  f"{r.reference.hit_ratio:.4f}", round(r.ttft_saved_s, 1), round(r.wall_s, 1)]
                 for r in reports])
