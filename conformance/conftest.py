"""The kvhal conformance suite: `pytest conformance/ [--kvhal-backend=NAME ...]
[--kvhal-tier=NAME ...]` (conformance/README.md walks a backend or tier author through it).

Two suites: the backend suite (the HAL and layout modules: every test that does not take
`tier_name`) and the tier suite (every test that takes `tier_name`). `--kvhal-backend` alone
runs the backend suite, `--kvhal-tier` alone the tier suite, both or neither run both. Every
test that takes the `backend` fixture runs once per selected backend (default: every
registered backend; unavailable ones are skipped with the backend's own reason).
"""
from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from kvhal import plugins

from .s3 import s3_server  # noqa: F401
from .tier_fixtures import (cpu_backend, harness, host, namespace, open_tier,  # noqa: F401
                            shared_store)
from .tier_fixtures import selected_tiers
from .tier_harness import harnesses


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add `--kvhal-backend NAME` and `--kvhal-tier NAME` (both repeatable)."""
    parser.addoption("--kvhal-backend", action="append", default=None, metavar="NAME",
                     help="backend(s) to run the conformance suite on (default: all registered)")
    parser.addoption("--kvhal-tier", action="append", default=None, metavar="NAME",
                     help="secondary tier(s) to run the tier conformance suite on (default: "
                          "every tier with a harness in conformance/tier_harness.py)")


def pytest_configure(config: pytest.Config) -> None:
    """Refuse an unknown `--kvhal-backend` name with one line listing the registered ones,
    instead of an error per test (an unavailable one still skips with its probe's reason)."""
    names = config.getoption("--kvhal-backend") or []
    registered = plugins.backends()
    unknown = [n for n in names if n not in registered]
    if unknown:
        raise pytest.UsageError(f"--kvhal-backend: {', '.join(map(repr, unknown))} not "
                                f"registered; registered: {', '.join(registered) or 'none'}")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize `backend_name` and `tier_name` over the selected backends and tiers."""
    if "backend_name" in metafunc.fixturenames:
        names = metafunc.config.getoption("--kvhal-backend") or list(plugins.backends())
        metafunc.parametrize("backend_name", names, scope="session")
    if "tier_name" in metafunc.fixturenames:
        # a test of chunks outliving their instance starts processes where the harness runs
        # services (p2p's keeper): slow for that tier
        slow = "shared_store" in metafunc.fixturenames
        metafunc.parametrize("tier_name", [
            pytest.param(name, marks=pytest.mark.slow if slow and harnesses()[name].services
                         else ()) for name in selected_tiers(metafunc.config)])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the suite not asked for: the tier suite under `--kvhal-backend` alone, the
    backend suite under `--kvhal-tier` alone (tests outside conformance/ are left alone)."""
    backend_chosen = bool(config.getoption("--kvhal-backend"))
    tier_chosen = bool(config.getoption("--kvhal-tier"))
    if backend_chosen == tier_chosen:
        return
    here = Path(__file__).parent
    keep, drop = [], []
    for item in items:
        ours = here in item.path.parents
        is_tier = "tier_name" in getattr(item, "fixturenames", ())
        (drop if ours and is_tier != tier_chosen else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


_instances: dict[str, object] = {}


@pytest.fixture(scope="session")
def backend(backend_name: str):
    """The backend under test (one instance per session), or a skip with its probe's reason."""
    spec = plugins.backend_spec(backend_name)
    probe = spec.cls.probe()
    if not probe.available:
        pytest.skip(f"backend {backend_name} unavailable: {probe.reason}")
    if backend_name not in _instances:
        _instances[backend_name] = spec.cls()
    return _instances[backend_name]


@pytest.fixture(scope="session")
def chaos_backend(backend_name: str, backend):
    """The backend in chaos mode where it has one (a `chaos_seed` constructor argument, as the
    cpu reference has); real accelerators are asynchronous on their own and use `backend`."""
    cls = type(backend)
    if "chaos_seed" in inspect.signature(cls).parameters:
        return cls(chaos_seed=1234)
    return backend


def require(backend, capability: str) -> None:
    """Skip unless the backend declares `capability` (a `Capabilities` field)."""
    if not getattr(backend.capabilities(), capability):
        pytest.skip(f"capability {capability} not declared by {backend.name}")
