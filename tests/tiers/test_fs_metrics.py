"""The fs tier's own metrics (`FsTier.metric_specs`): durable write latency and the files its
budget removed, counted as the tier does the work (real files under tmp_path)."""
from __future__ import annotations

import glob
import os

import pytest

from kvhal.tiers.fs import FsTier

from .helpers import NAMESPACE, chunk_key, host_region, payload, store
from .test_fs_recycle import NBYTES, RECORD, _fill


@pytest.fixture
def region():
    return host_region(1 << 20)


def _figures(tier, name: str) -> list[float]:
    """The figures of `name`'s one series (histogram: bucket counts, +Inf, sum, count)."""
    series = tier.metrics.snapshot().get(name, {})
    assert set(series) <= {()}
    return series.get((), [])


@pytest.mark.parametrize("nbytes", [NBYTES, NBYTES + 1], ids=["batched", "alone"])
@pytest.mark.parametrize("durability,want", [("power-loss", 3), ("process", 0)])
def test_durable_writes_are_timed_once_each(tmp_path, region, durability, want, nbytes):
    """Whole-block payloads are written in one call per batch (`write_chunks`), others one by
    one (`write_chunk`): both are timed."""
    host, array = region
    tier = FsTier({"root_dir": str(tmp_path), "refresh_interval_s": 3600,
                   "durability": durability}, host, NAMESPACE)
    try:
        for seed in (1, 2, 3):
            array[:nbytes] = payload(seed, nbytes)
            assert store(tier, chunk_key(NAMESPACE, seed), 0, nbytes).ok
        figures = _figures(tier, "sync_write_seconds")
    finally:
        tier.close()
    assert (figures[-1] if figures else 0) == want
    if want:
        assert figures[-2] > 0      # seconds summed


def test_files_the_budget_removes_are_counted(tmp_path, region):
    host, array = region
    tier = FsTier({"root_dir": str(tmp_path), "refresh_interval_s": 3600,
                   "max_bytes": 2 * RECORD, "recycle_files": False}, host, NAMESPACE)
    try:
        _fill(tier, array, [1, 2, 3, 4])        # each of the last two evicts one
        removed = _figures(tier, "budget_removed_files")
        files = glob.glob(os.path.join(tier.ns_dir, "**", "*.kv*"), recursive=True)
    finally:
        tier.close()
    assert removed == [2.0]
    assert len(files) == 2
