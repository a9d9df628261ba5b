"""`kvhal bench engine --busy-fs`: the busy fs tier really pauses for the idle passes."""
from __future__ import annotations

from kvhal.integrations.harness.bench.engine import BusyFsTier, bookkeeping_busy_idle

from ..tiers.helpers import wait_for


def test_a_paused_busy_tier_moves_nothing_and_resumes(tmp_path):
    with BusyFsTier(str(tmp_path), chunks=4, chunk_bytes=1 << 16) as fs:
        assert fs.bytes_moved() > 0
        fs.pause()
        paused_at = fs.bytes_moved()
        busy, idle = bookkeeping_busy_idle(fs, chunks=20, capacity=200, repeats=3)
        fs.pause()
        stopped = fs.bytes_moved()
        # the batches of the three busy passes moved bytes; nothing moves once paused
        assert stopped > paused_at and stopped % (1 << 16) == 0
        assert fs.bytes_moved() == stopped
        fs.resume()
        wait_for(lambda: fs.bytes_moved() > stopped, 30.0, "the resumed tier to move bytes")
    for result in (busy, idle):
        assert result.chunks == 20
        assert 0 < result.lookup_us <= result.lookup_median_us
        assert 0 < result.store_us <= result.store_median_us
        assert 0 < result.load_us <= result.load_median_us
