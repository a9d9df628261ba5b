"""The engine side of `test_cost_link.py`, run inside an emulated link's namespace:
`python -m tests.engine.cost_link_child COST_MODEL_JSON`.

A local S3 server (moto, a process of its own) and an engine whose one secondary tier is the
obj tier on it, both talking over the namespace's shaped loopback. `CHUNKS` chunks are stored
(and cascade to the obj tier). Then, for each line `PHASE N` read from stdin, N requests each
find the prefix in the obj tier only (host memory cleared) and look it up once: the answer
for its first chunk is the cost model's decision (RETRY: load, MISS: recompute); every
promotion it starts (a load, or a background probe) is waited for before the next request.
One JSON line per phase: {"phase", "decisions": ["load" | "recompute", ...], "seconds": [per
request], "bandwidth": [the tier's estimate after each request, B/s]}.
"""
from __future__ import annotations

import json
import sys
import time

from kvhal.integrations.harness.bench.tier_obj import bucket_config
from kvhal.tier import Lookup

from .rig import chunk_blocks, make_rig, synthetic_keys

CHUNK_BYTES = 256 << 10
CHUNKS = 8
TOKENS_PER_CHUNK = 256


def _settle(manager, timeout_s: float = 120.0) -> None:
    """Poll until no tier job is in flight (the engine's own collection of results)."""
    deadline = time.monotonic() + timeout_s
    while manager.stats()["tier_jobs"]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"tier jobs still in flight after {timeout_s} s")
        manager.poll()
        time.sleep(0.002)


def main(cost_model: dict) -> None:
    with bucket_config({"type": "obj", "io_threads": 4}) as tier:
        rig = make_rig(capacity=2 * CHUNKS, blocks_per_chunk=1, block_bytes=CHUNK_BYTES,
                       num_blocks=CHUNKS, tiers=[tier], tokens_per_chunk=TOKENS_PER_CHUNK,
                       config={"cost_model": cost_model})
        manager = rig.manager
        try:
            keys = synthetic_keys(CHUNKS)
            rig.store(keys, chunk_blocks(0, CHUNKS, 1))
            manager.drain(120)
            link = manager.cost.links[0]
            print(json.dumps({"ready": True}), flush=True)
            for line in sys.stdin:
                phase, n = line.split()
                decisions, seconds, bandwidth = [], [], []
                for _ in range(int(n)):
                    manager.clear()
                    t0 = time.perf_counter()
                    answer = manager.lookup(keys)[0]
                    _settle(manager)
                    seconds.append(time.perf_counter() - t0)
                    decisions.append("load" if answer is Lookup.RETRY else "recompute")
                    bandwidth.append(link.bandwidth_bytes_per_s)
                print(json.dumps({"phase": phase, "decisions": decisions, "seconds": seconds,
                                  "bandwidth": bandwidth}), flush=True)
        finally:
            rig.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
