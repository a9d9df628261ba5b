"""`--link RATE[,RTT] ...` of the network benches (`kvhal bench p2p`, `kvhal bench tier --tier
obj`): the same bench, once per link, run whole inside an emulated link's namespace
(`integrations/harness/link.py`: every process of the run, servers included, talks over that
namespace's loopback shaped to the rate), its `--json` collected; then the side-by-side rows
and the crossover: the highest rate up to which kvhal's verified path keeps ≥ the target
ratio of the raw loop at every rate measured."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from ..link import EmulatedLink, LinkSpec, parse_link, sweep_stale

#: Seconds one bench run inside a link may take.
RUN_TIMEOUT_S = 1800


def _link(text: str) -> LinkSpec:
    try:
        return parse_link(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_link_option(parser: argparse.ArgumentParser) -> None:
    """Add `--link RATE[,RTT] ...` (repeatable; e.g. `--link 10gbit 25gbit 40gbit`)."""
    parser.add_argument("--link", type=_link, nargs="+", action="extend", default=None,
                        metavar="RATE[,RTT]",
                        help="run the bench inside a network namespace whose loopback is "
                             "shaped to each RATE (tc tbf: 20mbit ... 100gbit) and print the "
                             "ratios side by side with the crossover; needs root; an RTT needs "
                             "the kernel's netem")


def run_on_links(argv: Sequence[str], specs: Sequence[LinkSpec]) -> list[tuple[LinkSpec, dict]]:
    """`kvhal <argv> --json` inside one emulated link per spec, in order; its parsed JSON.

    Raises:
        LinkError: a link cannot be made here (not root, no netem for an RTT).
        RuntimeError: a run failed (exit code other than 0 or 1; its stderr's tail is in the
            message) or printed no JSON.
    """
    sweep_stale()
    out = []
    for spec in specs:
        with EmulatedLink(spec) as link:
            done = link.run([sys.executable, "-m", "kvhal.cli", *argv, "--json"],
                            capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        if done.returncode not in (0, 1):
            raise RuntimeError(f"the bench at link {spec.label} failed ({done.returncode}): "
                               f"{done.stderr.strip()[-2000:]}")
        try:
            out.append((spec, json.loads(done.stdout)))
        except json.JSONDecodeError:
            raise RuntimeError(f"the bench at link {spec.label} printed no JSON: "
                               f"{done.stdout[-500:]!r}") from None
    return out


def crossover(points: Sequence[tuple[float, float]], target: float) -> float | None:
    """The highest rate r of `points` ((rate, ratio), any order) such that every rate ≤ r has
    ratio ≥ `target`; None if the slowest one is already below."""
    best = None
    for rate, ratio in sorted(points):
        if ratio < target:
            break
        best = rate
    return best
