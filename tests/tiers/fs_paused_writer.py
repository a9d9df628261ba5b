"""A process whose fs tier store hangs in its write (`test_fs_shared_budget.py` kills it there):

    python -m tests.tiers.fs_paused_writer ROOT MAX_BYTES

opens an `FsTier` on ROOT (`tests.tiers.helpers.NAMESPACE`) whose first `pwritev` waits
(`FaultyPausedOs`), submits one store of 4096 bytes (chunk 2), prints "paused" once the write
is reached (the store's bytes are reserved then) and waits to be killed."""
from __future__ import annotations

import sys
import time

from kvhal.tier import JobKind, TierJob
from kvhal.tiers.fs import FsTier

from .helpers import NAMESPACE, FaultyPausedOs, chunk_key, host_region, payload


def main(argv: list[str]) -> None:
    host, array = host_region()
    osm = FaultyPausedOs("pwritev")
    tier = FsTier({"root_dir": argv[0], "max_bytes": int(argv[1]), "refresh_interval_s": 3600},
                  host, NAMESPACE, os_module=osm)
    array[:4096] = payload(2, 4096)
    tier.submit_store(TierJob(1, JobKind.STORE, chunk_key(NAMESPACE, 2), 0, 4096))
    assert osm.paused.wait(30)
    print("paused", flush=True)
    time.sleep(300)


if __name__ == "__main__":
    main(sys.argv[1:])
