"""`kvhal replay --config` with an obj tier on a real moto_server: a second replay in a fresh
process (its index built by LIST) gets the hits the first one stored in the bucket."""
from __future__ import annotations

import json
import uuid

from conformance.s3 import s3_server, store_config  # noqa: F401

from .conftest import mooncake
from .test_fs_restart import kvhal_replay


def test_a_fresh_replay_hits_what_an_earlier_one_stored_in_the_bucket(s3_server, write_trace):
    config = {"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [
        {"type": "obj", "store_config": store_config(s3_server.endpoint),
         "prefix": f"replay/{uuid.uuid4().hex}"}]}
    first = write_trace([mooncake([1, 2, 3]), mooncake([4, 5])], "first.jsonl")
    out = kvhal_replay(first, config, "--device-bytes", "128K")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["traffic"]["obj"]["store"]["chunks"] == 5

    second = write_trace([mooncake([1, 2, 3, 6]),  # 1,2,3 promoted from obj; 6 stored
                          mooncake([4, 5]),        # from obj; evicts 6 and 3 from the device
                          mooncake([1, 2, 3, 6])],  # 1,2 on the device; 3,6 in host memory
                         "second.jsonl")
    out = kvhal_replay(second, config, "--device-bytes", "128K")

    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["hit_tokens"] == {"device": 2 * 512, "host": 2 * 512, "obj": 5 * 512}
    assert report["traffic"]["obj"]["load"]["chunks"] == 5
