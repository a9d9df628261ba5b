"""JobBoard: every job yields exactly one result, also when its function raises or the tier is
closed; drain honours its deadline. LanePool: a deep queue is handed over in batches, every
item exactly once; every thread serves loads while no store is queued, and only group 1 stores."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvhal.keys import ChunkKey
from kvhal.tier import JobKind, TierJob
from kvhal.tiers.jobs import JobBoard, JobPool, LanePool

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


def test_a_lane_pool_batches_a_deep_queue_and_runs_every_item_once():
    release, started = threading.Event(), threading.Event()
    batches: list[list[int]] = []

    def run(items):
        started.set()
        release.wait(10)
        batches.append(items)

    pool = LanePool((1, 1), "toy", (run, run), max_batch=4)
    pool.lanes[0].submit(0)
    assert started.wait(10)  # one thread holds item 0; the queue fills behind it
    for i in range(1, 30):
        pool.lanes[0].submit(i)
    release.set()
    pool.shutdown(wait=True)

    assert sorted(i for batch in batches for i in batch) == list(range(30))
    assert max(len(batch) for batch in batches) == 4


def test_a_lane_pool_hands_a_shallow_queue_over_item_by_item():
    batches: list[list[int]] = []
    done = threading.Semaphore(0)

    def run(items):
        batches.append(items)
        done.release()

    pool = LanePool((1, 1), "toy", (run, run), max_batch=4)
    for i in range(5):
        pool.lanes[i % 2].submit(i)
        assert done.acquire(timeout=10)
    pool.shutdown(wait=True)

    assert batches == [[0], [1], [2], [3], [4]]


def test_a_lane_pool_survives_a_raising_run_and_stops_all_threads():
    seen: list[int] = []

    def run(items):
        seen.extend(items)
        raise RuntimeError("bug")

    pool = LanePool((2, 1), "toy", (run, run), max_batch=8)
    for i in range(50):
        pool.lanes[i % 2].submit(i)
    pool.shutdown(wait=True)  # returns only once every queued item ran and every thread ended

    assert sorted(seen) == list(range(50))
    with pytest.raises(RuntimeError, match="toy: cannot submit after shutdown"):
        pool.lanes[1].submit(50)


def test_every_thread_of_a_lane_pool_runs_loads_while_no_store_is_queued():
    both_inside = threading.Barrier(2, timeout=10)   # broken (an error) unless 2 threads meet
    served: list[str] = []

    def run(items):
        both_inside.wait()
        served.append(threading.current_thread().name)

    pool = LanePool((1, 1), "toy", (run, lambda items: None), max_batch=1)
    pool.lanes[0].submit(0)
    pool.lanes[0].submit(1)
    pool.shutdown(wait=True)

    assert sorted(served) == ["toy_l0_0", "toy_l1_0"]


def test_a_lane_pool_runs_stores_on_group_1_only():
    gate, held, ran = threading.Event(), threading.Event(), threading.Semaphore(0)
    runs: dict[str, list[str]] = {}

    def run(items):
        for item in items:
            runs.setdefault(threading.current_thread().name, []).append(item)
            if item == "gate":
                held.set()
                assert gate.wait(10)
            else:
                ran.release()

    pool = LanePool((1, 1), "toy", (run, run), max_batch=1)
    pool.lanes[1].submit("gate")
    assert held.wait(10)                     # the store thread is held
    for i in range(3):
        pool.lanes[1].submit(f"s{i}")        # stores queue behind it: the load thread waits
    for i in range(3):
        pool.lanes[0].submit(f"a{i}")
    for _ in range(3):
        assert ran.acquire(timeout=10)       # the three loads, on the load thread
    gate.set()
    pool.shutdown(wait=True)

    assert runs == {"toy_l0_0": ["a0", "a1", "a2"], "toy_l1_0": ["gate", "s0", "s1", "s2"]}



@pytest.mark.parametrize("fn", [lambda jobs: 1 / 0, lambda jobs: []],
                         ids=["raises", "no-outcomes"])
def test_run_batch_fails_every_job_of_a_broken_batch(fn):
    board = JobBoard("toy")
    run = lambda jobs: board.run_batch(fn, jobs)  # noqa: E731
    pool = LanePool((1, 1), "toy", (run, run), max_batch=4)
    for i in range(3):
        board.submit(pool.lanes[i % 2], None, _job(i))
    board.drain(10)
    pool.shutdown()

    results = board.take_finished()
    assert sorted(r.job_id for r in results) == [0, 1, 2]
    assert all(not r.ok and r.error.startswith("internal error: ") for r in results)
    assert board.counters() == {"load_failed": 3}


def test_run_batch_reports_each_outcome():
    board = JobBoard("toy")
    run = lambda jobs: board.run_batch(  # noqa: E731
        lambda batch: [None if job.job_id % 2 else "not found" for job in batch], jobs)
    pool = LanePool((1, 1), "toy", (run, run), 4)
    for i in range(6):
        board.submit(pool.lanes[0], None, _job(i))
    board.drain(10)
    pool.shutdown()

    assert sorted((r.job_id, r.ok, r.error) for r in board.take_finished()) == [
        (i, bool(i % 2), None if i % 2 else "not found") for i in range(6)]


def test_a_lane_pool_batches_stores_by_the_store_threads_alone():
    gate, held = threading.Event(), threading.Event()
    batches: list[list[str]] = []

    def store(items):
        batches.append(items)
        if items == ["gate"]:
            held.set()
            assert gate.wait(10)

    pool = LanePool((4, 1), "toy", (lambda items: None, store), max_batch=8)
    pool.lanes[1].submit("gate")
    assert held.wait(10)
    for i in range(20):
        pool.lanes[1].submit(f"s{i}")
    gate.set()
    pool.shutdown(wait=True)

    # 20 queued for 1 store thread: batches of 8 (4 load threads idle do not count)
    assert [len(batch) for batch in batches] == [1, 8, 8, 4]


def _faulty_thread_start(monkeypatch) -> list[str]:
    """Make the second `Thread.start` of the test fail once, as when threads run out; returns
    the names of the threads asked to start."""
    real_start, calls = threading.Thread.start, []

    def faulty_start(thread):
        calls.append(thread.name)
        if len(calls) == 2:
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", faulty_start)
    return calls


def test_a_lane_pool_refuses_an_item_whose_thread_cannot_start_and_runs_it_never(monkeypatch):
    ran: list[str] = []
    calls = _faulty_thread_start(monkeypatch)
    pool = LanePool((1, 1), "toy", (ran.extend, ran.extend), max_batch=1)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        pool.lanes[1].submit("refused")
    pool.lanes[1].submit("accepted")          # starts the missing store thread
    pool.shutdown(wait=True)

    assert (ran, calls) == (["accepted"], ["toy_l0_0", "toy_l1_0", "toy_l1_0"])


@pytest.mark.parametrize("threads, max_batch", [((0, 1), 1), ((1, 0), 1), ((1, 1), 0)],
                         ids=["no-load-threads", "no-store-threads", "no-batch"])
def test_a_lane_pool_refuses_counts_below_one(threads, max_batch):
    with pytest.raises(ValueError) as refused:
        LanePool(threads, "toy", (list, list), max_batch)
    assert str(refused.value) == (f"toy: threads must be two counts >= 1 and max_batch >= 1 "
                                  f"(got threads={threads!r}, max_batch={max_batch})")


def test_a_job_whose_pool_thread_cannot_start_ends_once_as_not_run(monkeypatch):
    calls = _faulty_thread_start(monkeypatch)
    board, pool = JobBoard("toy"), JobPool(2, "toy")
    board.submit(pool, lambda job: None, _job(1))    # refused: thread toy_1 did not start
    board.submit(pool, lambda job: None, _job(2))    # starts toy_1, runs
    board.drain(10)
    pool.shutdown()

    assert sorted((r.job_id, r.ok, r.error) for r in board.take_finished()) == [
        (1, False, "not run: can't start new thread"), (2, True, None)]
    assert (calls, board.pending) == (["toy_0", "toy_1", "toy_1"], 0)
