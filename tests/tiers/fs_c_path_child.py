"""Child process of `test_fs_c_path.py`: runs fs tier jobs on the C I/O path (the real `os`
module) and prints one JSON line of what happened, for a parent that runs it under strace.

    python -m tests.tiers.fs_c_path_child ROOT DURABILITY DIRECTION COUNT NBYTES

DIRECTION "store": store COUNT chunks; "load": store them, then load each. The jobs of
DIRECTION run between two `getppid()` calls, markers for the parent's strace. The JSON holds
`fast_io` (the C helper is built and used), `results` ([ok, error] per job of DIRECTION),
`lookups` (per key after the jobs) and `temps` (temp files left in the chunk folders).
"""
from __future__ import annotations

import glob
import json
import os
import sys

from kvhal.tier import JobKind, TierJob
from kvhal.tiers.fs import FsTier, fileio

from .helpers import NAMESPACE, chunk_key, host_region, payload


def main(root: str, durability: str, direction: str, count: int, nbytes: int) -> None:
    host, array = host_region(2 * nbytes)
    tier = FsTier({"root_dir": root, "durability": durability, "refresh_interval_s": 3600},
                  host, NAMESPACE)
    keys = [chunk_key(NAMESPACE, i) for i in range(count)]
    array[:nbytes] = payload(0, nbytes)
    jobs = [TierJob(i, JobKind.STORE, k, 0, nbytes) for i, k in enumerate(keys)]
    if direction == "load":
        for job in jobs:
            tier.submit_store(job)
        tier.drain(60.0)
        assert all(r.ok for r in tier.get_finished_jobs())
        jobs = [TierJob(100 + i, JobKind.LOAD, k, nbytes, nbytes) for i, k in enumerate(keys)]
    os.getppid()
    for job in jobs:
        (tier.submit_store if job.kind is JobKind.STORE else tier.submit_load)(job)
    tier.drain(60.0)
    os.getppid()
    results = sorted((r.job_id, r.ok, r.error) for r in tier.get_finished_jobs())
    print(json.dumps({
        "fast_io": fileio.FAST_IO, "results": [[ok, error] for _, ok, error in results],
        "lookups": [tier.lookup(k).name for k in keys],
        "temps": glob.glob(os.path.join(tier.ns_dir, "chunks", "*", "*.tmp"))}))
    tier.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
