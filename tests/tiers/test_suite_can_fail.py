"""The tier conformance suite fails for a broken tier: an fs tier whose checksums are all
zeros (a `Faulty` checksum, so nothing is verified) serves bit-flipped chunks as ok."""
from __future__ import annotations

import pytest

from conformance import test_tier_damage as damage_suite
from conformance.tier_harness import harnesses
from kvhal.tiers.fs import fileio

from .helpers import NAMESPACE, host_region


def faulty_checksum(payload) -> bytes:
    """Stands in for xxh3-128: the same 16 zero bytes for any payload."""
    return bytes(16)


def test_damage_suite_catches_a_tier_that_does_not_verify(monkeypatch, tmp_path):
    monkeypatch.setattr(fileio, "payload_checksum", faulty_checksum)
    harness = harnesses()["fs"]
    host, _ = host_region(16 << 20)
    opened = []

    def open_tier(region, max_bytes=64 << 20):
        opened.append(harness.make(harness.config(str(tmp_path), max_bytes), region, NAMESPACE))
        return opened[-1]

    with pytest.raises(AssertionError):
        damage_suite.test_damaged_chunk_is_a_miss_every_time(harness, open_tier, NAMESPACE,
                                                             host, "bitflip-payload")
    for tier in opened:
        tier.close()
