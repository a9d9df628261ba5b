"""Mooncake Store pools for tests: `mooncake_master` processes on free loopback ports.

`mooncake_master` (function scope: a fresh, empty pool per test, killed at teardown; ~0.1 s)
and `shared_master()` (one per test process, for the conformance suite). Where the `mooncake`
extra or `libibverbs.so.1` is missing, tests that need a pool are skipped with the reason;
with `KVHAL_REQUIRE_MOONCAKE=1` (CI sets it) they fail instead, so CI cannot skip them
silently.
"""
from __future__ import annotations

import atexit
import os

import pytest

from kvhal.tiers.base import TierError
from kvhal.tiers.mooncake.client import store_class
from kvhal.tiers.mooncake.local_master import LocalMaster, master_binary

_SHARED: LocalMaster | None = None


def missing() -> str | None:
    """Why no Mooncake pool can run here, or None."""
    try:
        store_class()
    except TierError as exc:
        return str(exc)
    if master_binary() is None:
        return "mooncake_master not found: pip install 'kvhal[mooncake]'"
    return None


def require() -> None:
    """Skip the calling test where Mooncake is missing (fail under KVHAL_REQUIRE_MOONCAKE=1)."""
    reason = missing()
    if reason is None:
        return
    if os.environ.get("KVHAL_REQUIRE_MOONCAKE") == "1":
        pytest.fail(f"KVHAL_REQUIRE_MOONCAKE=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture
def mooncake_master():
    """A running `LocalMaster` of its own (client_ttl 2 s: a dead segment owner's objects go
    within seconds), killed at teardown."""
    require()
    master = LocalMaster({"client_ttl": "2"}).start()
    yield master
    master.kill()


def shared_master() -> LocalMaster:
    """This process's shared pool (started on first use, killed at exit)."""
    global _SHARED
    require()
    if _SHARED is None or not _SHARED.running:
        _SHARED = LocalMaster({"client_ttl": "2"}).start()
        atexit.register(_SHARED.kill)
    return _SHARED
