"""The `kvhal` console script: `kvhal <verb> ...`.

Each verb lives in its own module exposing `register(subparsers)`, which adds a sub-parser
whose `func(args) -> int` runs it. Exit code is non-zero on failure, with one line saying why.
"""
from __future__ import annotations

import argparse
import importlib
import sys

#: Modules that each contribute one verb.
COMMAND_MODULES = (
    "kvhal.doctor",
    "kvhal.bench",
    "kvhal.integrations.harness.cli",
    "kvhal.fsck",
    "kvhal.weights_cli",
    "kvhal.layout_cli",
    "kvhal.integrations.vllm.demo",
    "kvhal.integrations.pd.cli",
)


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser with every verb registered."""
    parser = argparse.ArgumentParser(prog="kvhal", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # e.g. `kvhal ... --json | head`: the reader left, not an error
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print("kvhal: interrupted", file=sys.stderr)
        return 130
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"kvhal {args.verb}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
