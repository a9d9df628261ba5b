"""`kvhal fingerprint PATH [--json]`: the content fingerprint kvhal puts in a namespace for a
checkpoint or LoRA adapter folder (or a GGUF file), with the files read and what it cost
(`kvhal.weights`). Two folders of identical weights print the same digest; an operator can
set it as `model_identity` to start engines without reading the weights again."""
from __future__ import annotations

import argparse
from dataclasses import asdict

from .report import print_json, print_table
from .weights import fingerprint


def run(args: argparse.Namespace) -> int:
    """Fingerprint `args.path` and print the result; returns 0.

    Raises:
        kvhal.weights.WeightsError: the path holds no weight file or cannot be read.
    """
    found = fingerprint(args.path)
    if args.json:
        print_json(asdict(found))
        return 0
    print_table(f"kvhal fingerprint {args.path}", ["digest", "files", "GB read", "seconds",
                                                   "GB/s"],
                [[found.digest, len(found.names), f"{found.nbytes / 1e9:.3f}", f"{found.seconds:.2f}",
                  f"{found.nbytes / 1e9 / max(found.seconds, 1e-9):.2f}"]])
    if args.list:
        print("\n".join(found.names))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `kvhal fingerprint`."""
    p = sub.add_parser("fingerprint", help="the weights' identity kvhal keys a namespace by")
    p.add_argument("path", help="a checkpoint or LoRA adapter folder, or a GGUF file")
    p.add_argument("--list", action="store_true", help="also list the files digested")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
