"""A P/D instance in its own process, for the P/D tests: `python -m tests.tiers.p2p_pd_peer CFG`.

CFG is a JSON object: the p2p tier config plus `"slots"` (host slots of `SLOT` bytes, default
8) and `"data_parallel_index"` (default 0: the engine's, as vLLM's connector passes it, through
`kvhal.config.build_tiers`). The process runs a real engine manager whose host tier the p2p
tier is attached to, prints
one JSON line `{"identity": "host:port"}` once it serves, then answers commands on stdin, one
line each:
    open CTX PARAMS_JSON    -> manager.open_request(CTX, params) (true/false)
    store CTX FIRST COUNT   -> chunks FIRST.. (bytes `payload(i, SLOT)`) stored for CTX;
                               answers how many were placed
    close CTX               -> manager.close_request(CTX); "ok"
    pull CTX FIRST COUNT    -> lookups of chunks FIRST.. for CTX (promotions start); "ok"
    stats                   -> tier stats + manager stats + "threads" (alive) as JSON
EOF closes the manager and exits 0.
"""
from __future__ import annotations

import json
import mmap
import sys
import threading

import numpy as np

from kvhal.config import build_tiers, parse_config
from kvhal.engine.manager import Manager
from kvhal.host.policy import LRUPolicy
from kvhal.host.slots import SlotTable

from .helpers import NAMESPACE, chunk_key, payload

SLOT = 64 << 10


def main(argv: list[str]) -> int:
    config = json.loads(argv[0])
    capacity = config.pop("slots", 8)
    index = config.pop("data_parallel_index", 0)
    host = memoryview(mmap.mmap(-1, SLOT * capacity))
    array = np.frombuffer(host, dtype=np.uint8)
    tier, = build_tiers(parse_config({"cpu_bytes_to_use": SLOT * capacity,
                                      "secondary_tiers": [config]}), host, NAMESPACE,
                        data_parallel_index=index)
    manager = Manager(SlotTable(capacity, LRUPolicy(capacity)), slot_bytes=SLOT,
                      chunk_nbytes=SLOT, tiers=[tier], emit_events=False)
    print(json.dumps({"identity": tier.identity}), flush=True)
    for line in sys.stdin:
        words = line.split(maxsplit=2)
        cmd = words[0] if words else ""
        if cmd == "open":
            print(json.dumps(manager.open_request(words[1], json.loads(words[2]))), flush=True)
        elif cmd in ("store", "pull"):
            first, count = (int(w) for w in words[2].split())
            keys = [chunk_key(NAMESPACE, i) for i in range(first, first + count)]
            if cmd == "pull":
                manager.lookup(keys, request_id=words[1])
                print("ok", flush=True)
                continue
            plan = manager.prepare_store(keys, request_id=words[1])
            placed = 0 if plan is None else len(plan.keys)
            if plan is not None:
                for index, slot in zip(plan.indices.tolist(), plan.slots.tolist()):
                    array[slot * SLOT:(slot + 1) * SLOT] = payload(first + index, SLOT)
                manager.complete_store(plan.job_id)
            manager.poll()
            print(placed, flush=True)
        elif cmd == "close":
            manager.close_request(words[1])
            manager.poll()
            print("ok", flush=True)
        elif cmd == "stats":
            manager.poll()
            print(json.dumps(dict(tier.stats()) | manager.stats()
                             | {"threads": threading.active_count()}), flush=True)
    manager.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
