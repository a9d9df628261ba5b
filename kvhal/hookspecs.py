"""pluggy hook specifications of kvhal (project name "kvhal", DESIGN §8).

Built-in backends, tiers and cache policies implement these hooks in modules listed under the
`kvhal` entry-point group, exactly as a third-party package does.
"""
from __future__ import annotations

from typing import Any

import pluggy

PROJECT = "kvhal"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def kvhal_register_backends() -> list[Any]:
    """Return `kvhal.plugins.BackendSpec`s for the device backends this plugin provides."""


@hookspec
def kvhal_register_tiers() -> list[Any]:
    """Return `kvhal.plugins.TierSpec`s for the secondary tiers this plugin provides."""


@hookspec
def kvhal_register_cache_policies() -> list[Any]:
    """Return `kvhal.plugins.PolicySpec`s for the host-tier cache policies it provides."""


@hookspec
def kvhal_register_layouts() -> list[Any]:
    """Return device-layout descriptors (`kvhal.layout`) this plugin provides."""


@hookspec
def kvhal_add_commands(subparsers: Any) -> None:
    """Add this plugin's `kvhal` CLI verbs to `subparsers` (argparse's sub-parsers action):
    each `subparsers.add_parser(VERB, ...)` sets `func(args) -> int` as its default. The core's
    own verbs (doctor, layout, fingerprint) are added first; a verb name taken twice is an
    argparse error naming it."""


@hookspec
def kvhal_kv_event(event: Any) -> None:
    """Observe one KV event (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`)."""


@hookspec
def kvhal_job_finished(job: Any) -> None:
    """Observe one finished job (`kvhal.engine.FinishedJob`: store or load, host or secondary
    tier, success or failure), called once per job on the thread that ended it (the engine's
    scheduler thread, holding the manager's lock: return quickly, never call the manager)."""
