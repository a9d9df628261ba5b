"""The `kvhal` console script: `kvhal <verb> ...`.

Each verb lives in its own module exposing `register(subparsers)`, which adds a sub-parser
whose `func(args) -> int` runs it; the core registers its own, plugins theirs through the
`kvhal_add_commands` hook. Exit code is non-zero on failure, with one line saying why.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from kvhal import plugins

#: The core's own verbs, one module each; plugins add theirs (`kvhal_add_commands`: tiers'
#: fsck, the proxy, the test harness's demo, replay and bench).
CORE_COMMANDS = ("kvhal.doctor", "kvhal.layout_cli", "kvhal.weights_cli")


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser: the core's verbs, then every plugin's."""
    parser = argparse.ArgumentParser(prog="kvhal", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for name in CORE_COMMANDS:
        importlib.import_module(name).register(sub)
    plugins.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code. A plugin that fails to load (its verbs
    are read from every plugin first) ends it with one line naming the entry point."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        parser = build_parser()
    except plugins.PluginError as exc:
        verb = next((a for a in argv if not a.startswith("-")), "")
        print(f"kvhal {verb}: error: {exc}".replace("kvhal : ", "kvhal: "), file=sys.stderr)
        return 1
    args = parser.parse_args(argv)
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
