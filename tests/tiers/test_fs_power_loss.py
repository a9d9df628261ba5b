"""What a power loss can leave of chunk files published without fsync (the default
`durability: "process"`), simulated on real files, and the opt-in `durability: "power-loss"`.

Without fsync, a file whose rename reached the journal may come back after a power loss with
size 0 (data never allocated), zeroed (allocated, never written), torn (some 4 KiB blocks of
the new data, others zero or stale) or short. Every such file must be a miss, never bytes, and
the key must become storable and loadable again.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from kvhal.tier import Lookup
from kvhal.tiers.chunk_format import HEADER_BYTES
from kvhal.tiers.fs import FsTier
from kvhal.tiers.fs.format import QUARANTINE_DIR, chunk_path

from .helpers import NAMESPACE, chunk_key, host_region, load, payload, store

NBYTES = 5 * 4096 + 1000  # five full blocks and a partial one: file of 1 + 6 blocks


def _zero(path, start, length):
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(bytes(length))


def _lose_power(path: str, kind: str) -> None:
    """Leave the chunk file at `path` as a power loss without fsync can (module docstring)."""
    size = os.path.getsize(path)
    if kind == "empty":
        os.truncate(path, 0)
    elif kind == "zeroed":
        _zero(path, 0, size)
    elif kind == "header-block-lost":
        _zero(path, 0, HEADER_BYTES)
    elif kind == "payload-block-lost":
        _zero(path, HEADER_BYTES + 2 * 4096, 4096)
    elif kind == "last-block-lost":
        _zero(path, size - 4096, 4096)
    elif kind == "stale-block":
        with open(path, "r+b") as f:
            f.seek(HEADER_BYTES + 4096)
            f.write(np.random.default_rng(7).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    elif kind == "short":
        os.truncate(path, HEADER_BYTES + 3 * 4096)
    else:
        raise AssertionError(kind)


def _open(root, host, **config) -> FsTier:
    return FsTier({"root_dir": str(root), "refresh_interval_s": 3600} | config, host, NAMESPACE)


#: Damage the restart scan sees in the header (not indexed) vs damage only the payload
#: checksum or the size check finds on load (indexed, then a failed load and quarantine).
SEEN_AT_SCAN = ("empty", "zeroed", "header-block-lost", "short")
SEEN_AT_LOAD = ("payload-block-lost", "last-block-lost", "stale-block")


@pytest.mark.parametrize("kind", SEEN_AT_SCAN + SEEN_AT_LOAD)
def test_a_file_damaged_by_power_loss_is_a_miss_and_the_key_heals(tmp_path, kind):
    host, array = host_region(1 << 20)
    tier = _open(tmp_path, host)
    key = chunk_key(NAMESPACE, 1)
    array[:NBYTES] = payload(1, NBYTES)
    assert store(tier, key, 0, NBYTES).ok
    tier.close()
    path = chunk_path(tier.ns_dir, key)
    _lose_power(path, kind)

    after = _open(tmp_path, host)                      # the restart after the power loss
    array[:] = 0xEE
    if kind in SEEN_AT_SCAN:
        assert after.lookup(key) is Lookup.MISS
    else:
        assert after.lookup(key) is Lookup.HIT
        result = load(after, key, 0, NBYTES)
        assert (result.ok, result.error) == (False, "corrupt: checksum mismatch")
        assert after.lookup(key) is Lookup.MISS and not os.path.exists(path)
        assert len(os.listdir(os.path.join(after.ns_dir, QUARANTINE_DIR))) == 1

    array[:NBYTES] = payload(1, NBYTES)                # recomputed, stored again
    assert store(after, key, 0, NBYTES).ok
    array[:NBYTES] = 0
    assert load(after, key, 0, NBYTES).ok
    np.testing.assert_array_equal(array[:NBYTES], payload(1, NBYTES))
    after.close()


class SyncCountingOs:
    """The real `os`, recording its fdatasync/fsync calls (all pass through; a real disk's
    syncs leave no trace a test could read back)."""

    def __init__(self) -> None:
        self.syncs: list[str] = []

    def __getattr__(self, name):
        return getattr(os, name)

    def fdatasync(self, fd):
        self.syncs.append("fdatasync")
        os.fdatasync(fd)

    def fsync(self, fd):
        self.syncs.append("fsync")
        os.fsync(fd)


@pytest.mark.parametrize("durability, syncs", [
    ("process", []), ("power-loss", ["fdatasync", "fsync"])], ids=["process", "power-loss"])
def test_durability_decides_the_syncs_of_a_store(tmp_path, durability, syncs):
    host, array = host_region(1 << 20)
    counting = SyncCountingOs()
    tier = FsTier({"root_dir": str(tmp_path), "durability": durability}, host, NAMESPACE,
                  os_module=counting)
    array[:NBYTES] = payload(2, NBYTES)

    assert store(tier, chunk_key(NAMESPACE, 2), 0, NBYTES).ok

    assert (counting.syncs, tier.stats()["durability"]) == (syncs, durability)
    tier.close()
