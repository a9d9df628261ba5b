"""A process storing into an fs tier whose namespace folder other processes share
(`test_fs_shared_budget.py`):

    python -m tests.tiers.fs_shared_worker ROOT MAX_BYTES FIRST ROUNDS GO_FILE

waits for GO_FILE to exist, then runs ROUNDS rounds against its own `FsTier` on ROOT
(`tests.tiers.helpers.NAMESPACE`, `max_bytes` MAX_BYTES, 4096-byte payloads, 8192-byte files).
A round submits `PER_ROUND` stores at once (chunks FIRST + ..., distinct per worker, and every
round one of `SHARED` chunks every worker stores), drains, measures the namespace's chunk-file
bytes (`*.kv`) while holding the usage ledger's lock (no kvhal process evicts or reserves
meanwhile, so the listing sees no file twice), then loads two chunks stored earlier and
checks their bytes. Prints one JSON line: {"samples": [bytes after each round], "stores_ok",
"stores_failed", "loads_ok", "load_misses", "wrong_bytes", "errors": [distinct store errors]}.
"""
from __future__ import annotations

import json
import os
import random
import sys
import time

import numpy as np

from kvhal.tier import JobKind, TierJob
from kvhal.tiers.fs import FsTier
from kvhal.tiers.fs.ledger import Ledger

from .helpers import NAMESPACE, chunk_key, host_region, kv_bytes, payload, run_jobs

NBYTES = 4096
PER_ROUND = 4
#: Chunk indexes every worker stores (the same files, written by several processes).
SHARED = range(1_000_000, 1_000_008)


def _index(first: int, round_: int, slot: int) -> int:
    return SHARED[round_ % len(SHARED)] if slot == 0 else first + round_ * PER_ROUND + slot


def main(argv: list[str]) -> None:
    root, max_bytes, first, rounds, go = argv[0], *map(int, argv[1:4]), argv[4]
    host, array = host_region((PER_ROUND + 2) * NBYTES)
    tier = FsTier({"root_dir": root, "max_bytes": max_bytes, "refresh_interval_s": 0.2,
                   "n_write_threads": 2, "n_read_threads": 2}, host, NAMESPACE)
    ledger = Ledger(tier.ns_dir, lambda: kv_bytes(tier.ns_dir))
    deadline = time.monotonic() + 60
    while not os.path.exists(go):
        assert time.monotonic() < deadline, "no go file"
        time.sleep(0.01)
    rng = random.Random(first)
    out = {"samples": [], "stores_ok": 0, "stores_failed": 0, "loads_ok": 0, "load_misses": 0,
           "wrong_bytes": 0, "errors": []}
    stored: list[int] = []
    job_id = 0
    for round_ in range(rounds):
        jobs = []
        for slot in range(PER_ROUND):
            i = _index(first, round_, slot)
            array[slot * NBYTES:(slot + 1) * NBYTES] = payload(i, NBYTES)
            job_id += 1
            jobs.append((i, TierJob(job_id, JobKind.STORE, chunk_key(NAMESPACE, i),
                                    slot * NBYTES, NBYTES)))
        results = run_jobs(tier, [job for _, job in jobs])
        for i, job in jobs:
            result = results[job.job_id]
            if result.ok:
                out["stores_ok"] += 1
                stored.append(i)
            else:
                out["stores_failed"] += 1
                if result.error not in out["errors"]:
                    out["errors"].append(result.error)
        with ledger.locked():
            out["samples"].append(kv_bytes(tier.ns_dir))
        for n, i in enumerate(rng.sample(stored, min(2, len(stored)))):
            offset = (PER_ROUND + n) * NBYTES
            job_id += 1
            result = run_jobs(tier, [TierJob(job_id, JobKind.LOAD, chunk_key(NAMESPACE, i),
                                             offset, NBYTES)])[job_id]
            if not result.ok:
                out["load_misses"] += 1
            elif np.array_equal(array[offset:offset + NBYTES], payload(i, NBYTES)):
                out["loads_ok"] += 1
            else:
                out["wrong_bytes"] += 1
    tier.close()
    ledger.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
