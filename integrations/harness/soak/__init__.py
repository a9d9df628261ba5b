"""`kvhal soak --minutes N --seed S`: a small fleet under load and faults, every answer checked.

The run itself is `driver.py` (with `fleet.py`, `faults.py`, `load.py`, `checks.py`,
`events.py`, `report.py`, `pull.py`); this module only adds the verb, and imports the run when
it is asked for: listing kvhal's verbs must work where the p2p, s3 or mooncake extras are not
installed (`pip install 'kvhal[vllm]'` and `kvhal demo`).
"""
from __future__ import annotations

import argparse

from . import faults as faultlib


def _run(args: argparse.Namespace) -> int:
    from .driver import run
    return run(args)


def register(sub: argparse._SubParsersAction) -> None:
    """Add `kvhal soak`."""
    p = sub.add_parser("soak", help="a kvhal fleet under load and faults, every answer "
                                    "checked (`integrations/harness/soak`)",
                       description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=3.0, help="load duration (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seeds the load and the faults")
    p.add_argument("--faults", default=",".join(faultlib.KINDS),
                   help=("comma-separated fault kinds (default all: "
                         f"{','.join(faultlib.KINDS)})"))
    p.add_argument("--fault-gap-s", type=float, default=25.0,
                   help="mean seconds between faults (default 25)")
    p.add_argument("--no-mooncake", dest="mooncake", action="store_false",
                   help="leave the mooncake tier (and the mooncake_restart fault) out even "
                        "where Mooncake is installed")
    p.add_argument("--workdir", default="kvhal-soak", help="logs, soak.json, soak.png")
    p.set_defaults(func=_run)

