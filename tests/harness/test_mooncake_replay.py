"""`kvhal replay --instances 2` with a mooncake tier on a real `mooncake_master`: the second
instance (its own device pool, host tier and Mooncake client) loads from the pool the prefix
the first one stored, and the report counts the pool's hits."""
from __future__ import annotations

import json

from conformance.mooncake import mooncake_master  # noqa: F401

from .conftest import mooncake
from .test_fs_restart import kvhal_replay


def test_the_second_instance_hits_in_the_pool_what_the_first_stored(mooncake_master,
                                                                    write_trace):
    """Fails when the replay attributes a hit whose tier is still checking its store (RETRY)
    to the host tier: e.g. without `_tier_of`'s RETRY case ({"host": 1536})."""
    config = {"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [
        mooncake_master.tier_config(refresh_interval_s=0.05)]}
    trace = write_trace([mooncake([1, 2, 3]),        # instance 0: stores 1, 2, 3
                         mooncake([1, 2, 3, 4], ts=2000)],   # instance 1: 1, 2, 3 from the pool
                        "two.jsonl")

    out = kvhal_replay(trace, config, "--device-bytes", "128K", "--instances", "2",
                       "--time-scale", "1")       # 2 s apart: the cascade has landed

    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["hit_tokens"] == {"device": 0, "host": 0, "mooncake": 3 * 512}
    assert report["traffic"]["mooncake"]["load"]["chunks"] == 3
