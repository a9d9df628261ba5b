"""Child-process bodies of the multi-process tier conformance tests.

Each runs in a separate process (multiprocessing "forkserver": a clean single-threaded parent
per child), builds the tier through its harness (`TierHarness.make`: the kvhal plugin registry,
then `ready`) from `(tier_name, config, namespace)`, hands each chunk stored ok to
`TierHarness.after_store` before reporting it (p2p: the keeper peer then holds it), and reports
over a queue or pipe. Payloads are `tier_fixtures.payload(i, n)`
for the chunk key `tier_fixtures.chunk_key(namespace, i)`, so every process agrees on them.
"""
from __future__ import annotations

import mmap
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time

import numpy as np

from kvhal.tier import JobKind, Lookup, TierJob

from .tier_fixtures import DRAIN_TIMEOUT_S, chunk_key, payload
from .tier_harness import harnesses

#: Seconds a reader keeps looping after the writers finished, waiting to see every chunk.
READER_GRACE_S = 30.0


def _exit_with_the_test() -> None:
    """End this worker at once if the test process dies (a killed test run must not leave
    workers behind). Its parent is the forkserver, which lives as long as any worker does, so
    `PR_SET_PDEATHSIG` would not do; multiprocessing gives the worker a sentinel of the process
    that asked for it, which turns readable when that process is gone."""
    test = multiprocessing.parent_process()

    def watch() -> None:
        multiprocessing.connection.wait([test.sentinel])
        os._exit(1)
    threading.Thread(target=watch, name="kvhal-worker-watchdog", daemon=True).start()


def _open(tier_name: str, config: dict, namespace: bytes, nbytes: int):
    _exit_with_the_test()
    region = mmap.mmap(-1, nbytes)
    host = memoryview(region)
    tier = harnesses()[tier_name].make(config, host, namespace)
    return tier, np.frombuffer(host, dtype=np.uint8), region


def same_key_writer(tier_name, config, namespace, rounds, nbytes, barrier, out) -> None:
    """Store chunk r in round r for r < rounds, starting each round together with the other
    writers (`barrier`); put ("writer", [errors]) on `out`."""
    tier, host, _region = _open(tier_name, config, namespace, nbytes)
    errors = []
    for r in range(rounds):
        host[:] = payload(r, nbytes)
        barrier.wait(DRAIN_TIMEOUT_S)
        tier.submit_store(TierJob(r, JobKind.STORE, chunk_key(namespace, r), 0, nbytes))
        tier.drain(DRAIN_TIMEOUT_S)
        failed = [res.error for res in tier.get_finished_jobs() if not res.ok]
        if not failed:
            harnesses()[tier_name].after_store(tier, config, chunk_key(namespace, r), nbytes)
        errors += failed
    tier.close()
    out.put(("writer", errors))


def looping_reader(tier_name, config, namespace, rounds, nbytes, writers_done, out) -> None:
    """Load every chunk it finds (lookup HIT) in a loop until the writers are done and it has
    loaded each of the `rounds` chunks at least once; put ("reader", loads, wrong, seen,
    failures) on `out`: `wrong` counts ok loads whose bytes differ from the payload."""
    tier, host, _region = _open(tier_name, config, namespace, nbytes)
    expected = [payload(r, nbytes) for r in range(rounds)]
    loads, wrong, seen, failures, job_id = 0, 0, set(), [], 0
    deadline = None
    while len(seen) < rounds and (deadline is None or time.monotonic() < deadline):
        if deadline is None and writers_done.is_set():
            deadline = time.monotonic() + READER_GRACE_S
        for r in range(rounds):
            if tier.lookup(chunk_key(namespace, r)) is not Lookup.HIT:
                continue
            job_id += 1
            tier.submit_load(TierJob(job_id, JobKind.LOAD, chunk_key(namespace, r), 0, nbytes))
            tier.drain(DRAIN_TIMEOUT_S)
            (res,) = tier.get_finished_jobs()
            if not res.ok:
                failures.append(res.error)
            elif np.array_equal(host, expected[r]):
                loads += 1
                seen.add(r)
            else:
                wrong += 1
    tier.close()
    out.put(("reader", loads, wrong, sorted(seen), failures))


def crash_writer(tier_name, config, namespace, first, count, nbytes, conn) -> None:
    """Store chunks first .. first+count-1 concurrently, sending "ready" once the tier is up
    and then each chunk index as soon as its store is reported ok; then wait to be killed."""
    tier, host, _region = _open(tier_name, config, namespace, count * nbytes)
    for i in range(count):
        host[i * nbytes:(i + 1) * nbytes] = payload(first + i, nbytes)
    conn.send("ready")
    for i in range(count):
        tier.submit_store(TierJob(first + i, JobKind.STORE, chunk_key(namespace, first + i),
                                  i * nbytes, nbytes))
    reported, harness = 0, harnesses()[tier_name]
    while reported < count:
        for res in tier.get_finished_jobs():
            reported += 1
            if res.ok:
                harness.after_store(tier, config, res.key, nbytes)
                conn.send(res.job_id)
        time.sleep(0.0005)
    conn.send("done")
    while True:  # the parent kills this process
        signal.pause()
