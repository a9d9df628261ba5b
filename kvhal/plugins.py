"""The plugin manager and registries of backends, tiers and cache policies (DESIGN §8).

Everything arrives through the `kvhal` entry-point group, built-ins included. Backend choice:
an explicit name (argument or env `KVHAL_BACKEND`), else the available backend with the highest
priority (cpu has the lowest).
"""
from __future__ import annotations

import functools
import importlib.metadata
import os
from dataclasses import dataclass
from typing import Any, Callable

import pluggy

from . import hookspecs
from .hal import BackendUnavailableError, DeviceBackend

#: Env var naming the backend to use (overrides priority order).
BACKEND_ENV = "KVHAL_BACKEND"


class PluginError(ValueError):
    """A plugin name is unknown or registered twice; the message names it and the choices."""


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """A registered device backend.

    Attributes:
        name: Unique name ("cpu", "cuda", ...), used by `--kvhal-backend` and `KVHAL_BACKEND`.
        cls: A class implementing `DeviceBackend` (its `probe()` must never raise).
        priority: Higher wins in automatic selection; cpu is 0.
    """

    name: str
    cls: type
    priority: int = 0


@dataclass(frozen=True, slots=True)
class TierSpec:
    """A registered secondary tier: `factory(config: dict, host_view: memoryview,
    namespace: bytes, **instance)`.

    `host_tail_bytes`: free bytes the tier wants after every host slot's page-rounded payload
    (0: none); the engine then cuts slots that much longer (`kvhal.host.host_geometry`) and
    tells the tier the slot size (`HostAccess.slot_bytes`). mooncake: a chunk record's header,
    so that slot s's record lies contiguous, its header in slot s-1's tail.

    `instance_keys`: facts about the serving engine instance the factory takes as keyword
    arguments (the integration knows them, the config does not; `kvhal.config.build_tiers`
    passes them): "data_parallel_index" (int ≥ 0, the engine's data-parallel index, vLLM's
    `parallel_config.data_parallel_index`; 0 outside vLLM). p2p: its listener's port offset."""

    name: str
    factory: Callable[..., Any]
    host_tail_bytes: int = 0
    instance_keys: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """A registered host-tier cache policy: `factory(capacity: int)` returns the policy."""

    name: str
    factory: Callable[..., Any]


@functools.cache
def plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager with every `kvhal` entry point loaded.

    Entry point names are plugin names and unique: a second entry point of the same name
    pointing elsewhere (e.g. a third-party `cpu` beside the built-in one) is refused, whichever
    comes first on `sys.path`. The same entry point seen twice (one distribution found twice)
    is registered once.

    Raises:
        PluginError: an entry point failed to import, or two entry points share a name; the
            message names each entry point involved, its module and its distribution (a broken
            third-party plugin is refused loudly, never skipped).
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    seen: dict[str, importlib.metadata.EntryPoint] = {}
    for ep in importlib.metadata.entry_points(group=hookspecs.PROJECT):
        first = seen.setdefault(ep.name, ep)
        if first is not ep:
            if first.value != ep.value:
                raise PluginError(f"two {hookspecs.PROJECT!r} entry points are named "
                                  f"{ep.name!r}: {_describe(first)} and {_describe(ep)}; a "
                                  "plugin name is registered once: rename the third-party one")
            continue
        if pm.is_blocked(ep.name):
            continue
        try:
            plugin = ep.load()
        except Exception as exc:  # noqa: BLE001 - any import failure of foreign code
            dist = ep.dist.name if ep.dist is not None else "?"
            raise PluginError(f"entry point {ep.name!r} = {ep.value!r} (distribution {dist!r}, "
                              f"group {hookspecs.PROJECT!r}) failed to load: "
                              f"{type(exc).__name__}: {exc}") from exc
        pm.register(plugin, name=ep.name)
    return pm


def _describe(ep: importlib.metadata.EntryPoint) -> str:
    """`'module' (distribution 'name', built in)` for an entry point of kvhal itself, else
    `'module' (distribution 'name')`."""
    dist = ep.dist.name if ep.dist is not None else "?"
    built_in = ", built in" if dist == hookspecs.PROJECT else ""
    return f"{ep.value!r} (distribution {dist!r}{built_in})"


def _collect(hook: Any, kind: str, spec_type: type | None = None) -> dict[str, Any]:
    """Call each implementation of a `kvhal_register_*` hook; index the specs by name.

    Raises:
        PluginError: a plugin returned something other than a list of `spec_type` (or of
            objects with a str `name`), or two plugins registered the same name; the message
            names the plugin(s).
    """
    out: dict[str, Any] = {}
    owner: dict[str, str] = {}
    for impl in reversed(hook.get_hookimpls()):  # the order pluggy calls them in
        if impl.hookwrapper or impl.wrapper:
            continue
        specs = impl.function()
        if specs is None:
            continue
        if not isinstance(specs, (list, tuple)):
            raise PluginError(f"plugin {impl.plugin_name!r}: {hook.name} must return a list of "
                              f"{kind} specs, got {type(specs).__name__}")
        for spec in specs:
            if (spec_type is not None and not isinstance(spec, spec_type)) or \
                    not isinstance(getattr(spec, "name", None), str):
                raise PluginError(f"plugin {impl.plugin_name!r}: {hook.name} returned "
                                  f"{spec!r}, not a {(spec_type or object).__name__} with a "
                                  "str name")
            if spec.name in out:
                raise PluginError(f"{kind} {spec.name!r} is registered twice, by plugins "
                                  f"{owner[spec.name]!r} and {impl.plugin_name!r}")
            out[spec.name], owner[spec.name] = spec, impl.plugin_name
    return out


def backends() -> dict[str, BackendSpec]:
    """Every registered backend, by name, highest priority first."""
    found = _collect(plugin_manager().hook.kvhal_register_backends, "backend", BackendSpec)
    return dict(sorted(found.items(), key=lambda kv: -kv[1].priority))


def tiers() -> dict[str, TierSpec]:
    """Every registered secondary tier type, by name."""
    return _collect(plugin_manager().hook.kvhal_register_tiers, "tier", TierSpec)


def cache_policies() -> dict[str, PolicySpec]:
    """Every registered host-tier cache policy, by name."""
    return _collect(plugin_manager().hook.kvhal_register_cache_policies, "cache policy",
                    PolicySpec)


def layouts() -> dict[str, Any]:
    """Every registered device layout descriptor, by name."""
    return _collect(plugin_manager().hook.kvhal_register_layouts, "layout")


def backend_spec(name: str) -> BackendSpec:
    """The spec registered as `name`.

    Raises:
        PluginError: no backend of that name; the message lists the registered ones.
    """
    found = backends()
    if name not in found:
        raise PluginError(f"backend {name!r} is not registered; registered: "
                          f"{', '.join(found) or 'none'}")
    return found[name]


def select_backend(name: str | None = None, **kwargs: Any) -> DeviceBackend:
    """Construct the backend to use.

    Args:
        name: Explicit backend name; None reads `KVHAL_BACKEND`, and if that is unset picks the
            available backend of highest priority.
        kwargs: Passed to the backend's constructor.

    Raises:
        PluginError: the named backend is not registered.
        BackendUnavailableError: the named backend cannot run here (with its probe's reason).
    """
    name = name or os.environ.get(BACKEND_ENV) or None
    if name is not None:
        spec = backend_spec(name)
        probe = spec.cls.probe()
        if not probe.available:
            raise BackendUnavailableError(f"backend {name!r} is unavailable: {probe.reason}",
                                          backend=name)
        return spec.cls(**kwargs)
    for spec in backends().values():
        if spec.cls.probe().available:
            return spec.cls(**kwargs)
    raise BackendUnavailableError("no registered backend is available", backend="none")


def add_commands(subparsers: Any) -> None:
    """Let every plugin add its CLI verbs (`kvhal_add_commands`) to argparse's `subparsers`."""
    plugin_manager().hook.kvhal_add_commands(subparsers=subparsers)


def emit_kv_event(event: Any) -> None:
    """Deliver a KV event to every `kvhal_kv_event` hook implementation."""
    plugin_manager().hook.kvhal_kv_event(event=event)


def job_listeners() -> bool:
    """Whether a `kvhal_job_finished` hook implementation is registered now (the engine builds
    a finished job's record only then: it ends several jobs per step)."""
    return bool(plugin_manager().hook.kvhal_job_finished.get_hookimpls())


def emit_job_finished(job: Any) -> None:
    """Deliver a finished job (`kvhal.engine.FinishedJob`) to every `kvhal_job_finished` hook
    implementation."""
    plugin_manager().hook.kvhal_job_finished(job=job)
