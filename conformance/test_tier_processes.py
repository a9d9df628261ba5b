"""Tier conformance across processes (slow): concurrent writers of the same key while another
process reads in a loop, and writers killed with SIGKILL at seeded points
(`TierHarness.kill_points`: 100 for fs)."""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import random
import signal
import time

import numpy as np
import pytest

from kvhal.tiers.base import Lookup

from . import tier_workers
from .tier_fixtures import DRAIN_TIMEOUT_S, chunk_key, load, lookup, payload

pytestmark = pytest.mark.slow

WRITERS = 3
ROUNDS = 16
CHUNKS_PER_WRITER = 6


def _context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["numpy", "kvhal.tiers.fs", "conformance.tier_workers"])
    return ctx


@contextlib.contextmanager
def _reaped(procs):
    """SIGKILL and join whichever of `procs` still runs when the block is left (a failed
    assertion must not leave writers or readers behind)."""
    try:
        yield
    finally:
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                p.kill()
                p.join(30)


def _collect(out, procs, count: int, timeout_s: float = 120.0) -> list:
    """`count` reports from `out`; fails at once, naming the exit codes, when one of `procs`
    exits non-zero first (a crashed worker sends none), and after `timeout_s` otherwise."""
    reports, deadline = [], time.monotonic() + timeout_s
    while len(reports) < count:
        try:
            reports.append(out.get(timeout=0.2))
        except queue.Empty:
            crashed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not crashed, f"worker(s) exited with {crashed} before reporting"
            assert time.monotonic() < deadline, f"{count - len(reports)} report(s) missing"
    return reports


def test_concurrent_writers_of_one_key_and_a_looping_reader(harness, shared_store, namespace):
    if not harness.shared_by_processes:
        pytest.skip(f"{harness.name} is not shared by processes: {harness.why_not}")
    ctx = _context()
    config = harness.config(shared_store, 1 << 30)
    nbytes = (1 << 20) + 4099
    out, barrier, done = ctx.Queue(), ctx.Barrier(WRITERS), ctx.Event()
    args = (harness.name, config, namespace, ROUNDS, nbytes)
    reader = ctx.Process(target=tier_workers.looping_reader, args=args + (done, out))
    writers = [ctx.Process(target=tier_workers.same_key_writer, args=args + (barrier, out))
               for _ in range(WRITERS)]

    with _reaped(writers + [reader]):
        reader.start()
        for w in writers:
            w.start()
        reports = _collect(out, writers, WRITERS)
        done.set()
        reports += _collect(out, [reader], 1)
        for p in writers + [reader]:
            p.join(30)

    assert [p.exitcode for p in writers + [reader]] == [0] * (WRITERS + 1)
    assert sorted(r for r in reports if r[0] == "writer") == [("writer", [])] * WRITERS
    (_, loads, wrong, seen, failures), = [r for r in reports if r[0] == "reader"]
    assert (wrong, failures, seen) == (0, [], list(range(ROUNDS)))
    assert loads >= ROUNDS
    if harness.stored_objects is not None:
        complete, temps = harness.stored_objects(config)
        assert (len(complete), temps) == (ROUNDS, [])


def _kill_at(ctx, harness, config, namespace, first, nbytes,
             delay_s: float | None) -> tuple[list[int], float]:
    """Run a crash writer and SIGKILL it `delay_s` after it is ready (None: once it reports
    every store finished). Returns the chunk indexes it reported stored and the seconds from
    ready to kill."""
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=tier_workers.crash_writer,
                       args=(harness.name, config, namespace, first, CHUNKS_PER_WRITER, nbytes,
                             child))
    with _reaped([proc]):
        proc.start()
        child.close()
        assert parent.poll(DRAIN_TIMEOUT_S) and parent.recv() == "ready"
        t0 = time.perf_counter()
        stored = []
        if delay_s is None:
            while (msg := parent.recv()) != "done":
                stored.append(msg)
        else:
            time.sleep(delay_s)  # the seeded kill point
        os.kill(proc.pid, signal.SIGKILL)
    elapsed = time.perf_counter() - t0
    proc.join(DRAIN_TIMEOUT_S)
    assert proc.exitcode == -signal.SIGKILL
    while parent.poll(0):
        try:
            msg = parent.recv()
        except EOFError:
            break
        if isinstance(msg, int):
            stored.append(msg)
    return stored, elapsed


def _stored_counts(harness, config) -> tuple[int, int]:
    """(complete objects, temp objects) in the store now; (0, 0) where the harness cannot
    list them."""
    if harness.stored_objects is None:
        return 0, 0
    complete, temps = harness.stored_objects(config)
    return len(complete), len(temps)


def test_sigkilled_writers_never_leave_a_torn_chunk(harness, shared_store, namespace, host):
    """Writers SIGKILLed at seeded points leave every chunk they reported stored loadable and
    no chunk with wrong bytes; at least one kill must land mid-store (the writer reported some
    but not all of its chunks, or left a temp object, or a complete object it had not
    reported: an unsettled chunk), so the test cannot pass with every kill before the first
    write or after the last.

    Fails when a kill tears a chunk (wrong bytes load ok) or loses a reported one; and when the
    kills miss the stores: e.g. with every kill point moved before the writer starts storing
    (the parent killing it before "ready") or after it is done (`delay = 2 * span_s`): "no
    kill of 20 landed mid-store" (obj).
    """
    if not harness.persistent:
        pytest.skip(f"{harness.name} is not persistent: {harness.why_not}")
    ctx = _context()
    config = harness.config(shared_store, 1 << 30)
    nbytes = (256 << 10) + 3
    first = harness.kill_points * CHUNKS_PER_WRITER  # the calibration run's chunks come after
    stored_all, span_s = _kill_at(ctx, harness, config, namespace, first, nbytes, None)
    assert sorted(stored_all) == list(range(first, first + CHUNKS_PER_WRITER))
    complete, _ = _stored_counts(harness, config)
    partial = temps_left = unsettled = 0
    for point in range(harness.kill_points):  # kill points spread over 1.5x an unkilled writer's time
        delay = random.Random(point).uniform(0, 1.5 * span_s)
        stored, _ = _kill_at(ctx, harness, config, namespace, point * CHUNKS_PER_WRITER,
                             nbytes, delay)
        stored_all += stored
        now_complete, now_temps = _stored_counts(harness, config)  # before the next writer
        partial += 0 < len(stored) < CHUNKS_PER_WRITER
        temps_left += now_temps > 0
        unsettled += now_complete - complete > len(stored)
        complete = now_complete
    assert partial + temps_left + unsettled > 0, (
        f"no kill of {harness.kill_points} landed mid-store (span {span_s:.3f} s)")

    tier = harness.make(config, host, namespace)
    try:
        array = np.frombuffer(host, dtype=np.uint8)
        for i in range(first + CHUNKS_PER_WRITER):
            key = chunk_key(namespace, i)
            if i in stored_all:
                assert lookup(tier, key) is Lookup.HIT, f"stored chunk {i} lost"
            if lookup(tier, key) is Lookup.HIT:
                result = load(tier, key, 0, nbytes, job_id=i)
                assert result.ok, f"chunk {i}: {result.error}"
                np.testing.assert_array_equal(array[:nbytes], payload(i, nbytes))
    finally:
        tier.close()
