"""JobBoard: every job yields exactly one result, also when its function raises or the tier is
closed; drain honours its deadline."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvhal.keys import ChunkKey
from kvhal.tiers.base import JobKind, TierJob
from kvhal.tiers.jobs import JobBoard

from .helpers import NAMESPACE

KEY = ChunkKey(NAMESPACE, 0, bytes(32))


def _job(i: int, kind: JobKind = JobKind.LOAD) -> TierJob:
    return TierJob(i, kind, KEY, 0, 1)


def test_results_errors_and_counters():
    board = JobBoard("toy")
    with ThreadPoolExecutor(2) as pool:
        board.submit(pool, lambda job: None, _job(1))
        board.submit(pool, lambda job: "not found", _job(2))
        board.submit(pool, lambda job: 1 / 0, _job(3, JobKind.STORE))
        board.drain(10)

    results = {r.job_id: (r.ok, r.error) for r in board.take_finished()}

    assert results == {1: (True, None), 2: (False, "not found"),
                       3: (False, "internal error: ZeroDivisionError: division by zero")}
    assert board.counters() == {"load_failed": 1, "store_failed": 1}
    assert board.take_finished() == []


def test_a_closed_board_fails_new_jobs_at_once():
    board = JobBoard("toy")
    assert board.close() is True
    assert board.close() is False
    with ThreadPoolExecutor(1) as pool:
        board.submit(pool, lambda job: None, _job(1))

    assert [(r.job_id, r.ok, r.error) for r in board.take_finished()] == [(1, False,
                                                                           "tier closed")]


def test_drain_times_out_while_a_job_runs():
    board = JobBoard("toy")
    release = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        board.submit(pool, lambda job: release.wait(10) and None, _job(1))
        with pytest.raises(TimeoutError, match="toy tier: 1 jobs still pending after 0.05 s"):
            board.drain(0.05)
        release.set()
        board.drain(10)
    assert [r.ok for r in board.take_finished()] == [True]
