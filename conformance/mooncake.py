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

from kvhal.tier import TierError
from kvhal.tiers.mooncake.client import store_class
from kvhal.tiers.mooncake.local_master import LocalMaster, SegmentKeeper, master_binary

#: Memory the conformance pool's keeper lends (every instance of the suite lends none).
KEEPER_BYTES = 256 << 20
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
    """This process's shared pool: a master and a `SegmentKeeper` of `KEEPER_BYTES` (started
    on first use, killed at exit), so chunks outlive the instances that stored them."""
    global _SHARED
    require()
    if _SHARED is None or not _SHARED.running:
        _SHARED = LocalMaster({"client_ttl": "2", "default_kv_lease_ttl": "1000"}).start()
        keeper = SegmentKeeper(_SHARED, KEEPER_BYTES).start()
        atexit.register(_SHARED.kill)
        atexit.register(keeper.kill)
    return _SHARED


def config(tmp: str, max_bytes: int) -> dict:
    """The conformance config: the shared pool, a prefix of this test's own (`tmp`), no memory
    lent by the instance (`max_bytes` unused: the pool's master evicts)."""
    import hashlib
    return shared_master().tier_config(
        global_segment_size=0, refresh_interval_s=0.02, sweep_interval_s=0.02, timeout_s=10.0,
        prefix="conformance/" + hashlib.sha256(tmp.encode()).hexdigest()[:16])


def damage(tier, config: dict, key, kind: str, seed: int) -> None:
    """Replace `key`'s object by a damaged copy (bit flip, cut short) or remove it."""
    import random

    from kvhal.tiers.chunk_format import HEADER_BYTES, decode_header
    client, name = tier._client, tier.object_name(key)
    record = bytearray(client.get(name))
    assert client.remove(name, True) == 0
    if kind == "delete":
        return
    rng = random.Random(seed)
    if kind == "truncate":
        record = record[:rng.randrange(1, len(record))]
    else:
        lo, hi = (0, 64) if kind == "bitflip-header" else (
            HEADER_BYTES, HEADER_BYTES + decode_header(record[:HEADER_BYTES]).payload_nbytes)
        record[rng.randrange(lo, hi)] ^= 1 << rng.randrange(8)
    assert client.put(name, bytes(record)) == 0
