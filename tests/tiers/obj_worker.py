"""A separate process using a tier (obj or mooncake: the type its config names):
`python -m tests.tiers.obj_worker CONFIG_JSON OP FIRST COUNT NBYTES [hold]` stores (OP=store)
or loads and verifies (OP=load) chunks FIRST..FIRST+COUNT-1 (none: COUNT 0) of
`conformance.tier_fixtures.payload(i, NBYTES)` under `tests.tiers.helpers.NAMESPACE`, and
prints one JSON line: {"ok": [indexes that succeeded (and, for loads, matched)],
"errors": [...]}. With `hold`, it then keeps the tier open (a mooncake tier stays a pool
member, its segment serving what it stored) until its stdin closes."""
from __future__ import annotations

import json
import sys

import numpy as np

from kvhal import plugins
from kvhal.tier import JobKind, TierJob

from .helpers import NAMESPACE, chunk_key, host_region, payload


def main(argv: list[str]) -> None:
    config, op, first, count, nbytes = json.loads(argv[0]), argv[1], *map(int, argv[2:5])
    host, array = host_region(max(count, 1) * nbytes)
    tier = plugins.tiers()[config["type"]].factory(config, host, NAMESPACE)
    kind = JobKind.STORE if op == "store" else JobKind.LOAD
    for i in range(count):
        if kind is JobKind.STORE:
            array[i * nbytes:(i + 1) * nbytes] = payload(first + i, nbytes)
        (tier.submit_store if kind is JobKind.STORE else tier.submit_load)(
            TierJob(first + i, kind, chunk_key(NAMESPACE, first + i), i * nbytes, nbytes))
    tier.drain(60)
    ok, errors = [], []
    for r in sorted(tier.get_finished_jobs(), key=lambda r: r.job_id):
        i = r.job_id - first
        same = kind is JobKind.STORE or np.array_equal(array[i * nbytes:(i + 1) * nbytes],
                                                       payload(r.job_id, nbytes))
        (ok.append(r.job_id) if r.ok and same else errors.append(r.error or "wrong bytes"))
    print(json.dumps({"ok": ok, "errors": errors}), flush=True)
    if argv[5:] == ["hold"]:
        sys.stdin.read()
    tier.close()


if __name__ == "__main__":
    main(sys.argv[1:])
