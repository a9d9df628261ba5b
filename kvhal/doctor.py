"""`kvhal doctor`: every registered backend, whether it can run here (and why not), and what it
really supports."""
from __future__ import annotations

import argparse
import dataclasses

from . import plugins
from .report import print_json, print_table


def collect() -> list[dict]:
    """One dict per registered backend: name, priority, available, reason, capabilities."""
    rows = []
    for name, spec in plugins.backends().items():
        probe = spec.cls.probe()
        row = {"name": name, "priority": spec.priority, "available": probe.available,
               "reason": probe.reason, "capabilities": None}
        if probe.available:
            try:
                backend = spec.cls()
                row["capabilities"] = dataclasses.asdict(backend.capabilities())
            except Exception as exc:  # noqa: BLE001 - doctor reports, never crashes
                row["available"], row["reason"] = False, f"construction failed: {exc}"
        rows.append(row)
    return rows


def run(args: argparse.Namespace) -> int:
    """Print the backend table (or JSON); exit 1 if no backend at all is available."""
    rows = collect()
    if args.json:
        print_json({"backends": rows})
    else:
        table = []
        for r in rows:
            caps = r["capabilities"] or {}
            status = "available" if r["available"] else f"unavailable: {r['reason']}"
            feats = ", ".join(k for k in ("page_locked_host", "native_batch", "native_copy_2d",
                                          "event_timing", "host_register") if caps.get(k))
            table.append([r["name"], r["priority"], status, feats,
                          "; ".join(caps.get("notes", ()))])
        print_table("kvhal backends", ["backend", "priority", "status", "capabilities",
                                       "notes"], table)
    return 0 if any(r["available"] for r in rows) else 1


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `doctor` verb."""
    p = sub.add_parser("doctor", help="list backends, availability and capabilities")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
