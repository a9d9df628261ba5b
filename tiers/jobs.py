"""Job bookkeeping shared by the tiers that run their I/O on thread pools (fs, obj, p2p).

`JobBoard` runs a tier's job functions on the tier's executors and keeps the contract of
`SecondaryTier` (DESIGN §6): every submitted job yields exactly one `JobResult`, even when the
job function raises or the tier is closed; `drain` waits for pending jobs with a deadline; the
named counters feed `stats()`. A job function takes the `TierJob` and returns None on success
or a short error string; it runs on a pool thread and never on the caller's.
"""
from __future__ import annotations

import collections
import queue
import threading
import time
from typing import Any, Callable, Sequence

from kvhal.keys import ChunkKey

from kvhal.tier import JobResult, Lookup, SecondaryTier, TierJob
from .index import ChunkIndex

JobFn = Callable[[TierJob], "str | None"]
#: A batch job function: one outcome (None or an error string) per job, in order.
BatchFn = Callable[[list[TierJob]], "list[str | None]"]


def internal_error(exc: Exception) -> str:
    """The outcome of a job whose function (or, in a batch, its own checks) raised `exc`: a bug
    or a malformed job, reported as the job's error instead of raised."""
    return f"internal error: {type(exc).__name__}: {exc}"


class _Threads:
    """What `JobPool` and `LanePool` share: daemon threads in groups (`sizes[g]` threads run
    `_work(g)`), started before the first item is queued, so an item whose thread cannot start
    is refused (RuntimeError) instead of queued where no thread may take it, and the next item
    tries again; items refused after `shutdown`, which lets the queued ones run.

    Args:
        name: Thread name prefix.
        sizes: Threads per group.
        thread_name: Format of a thread's name, with `name`, `group` and `i` (its number).
        lock: The lock that guards the subclass's queues too.
    """

    def __init__(self, name: str, sizes: tuple[int, ...], thread_name: str,
                 lock: threading.Lock):
        self._name, self._sizes, self._thread_name = name, sizes, thread_name
        self._lock = lock
        self._threads: list[threading.Thread] = []
        self._started = [0] * len(sizes)
        self._shutdown = False

    def _admit(self) -> None:
        """Check that an item may be queued now, starting any thread not started yet (all of
        them at the first item). Lock held.

        Raises:
            RuntimeError: the pool was shut down, or a thread could not start (the ones
                started run on).
        """
        if self._shutdown:
            raise RuntimeError(f"{self._name}: cannot submit after shutdown")
        for group, size in enumerate(self._sizes):
            while self._started[group] < size:
                thread = threading.Thread(target=self._work, args=(group,), daemon=True,
                                          name=self._thread_name.format(
                                              name=self._name, group=group,
                                              i=self._started[group]))
                thread.start()
                self._threads.append(thread)
                self._started[group] += 1

    def _work(self, group: int) -> None:
        raise NotImplementedError

    def _wake_all(self, threads: int) -> None:
        """Make each of `threads` idle threads look at the queues again (shutdown). Lock held."""
        raise NotImplementedError

    def shutdown(self, wait: bool = True) -> None:
        """Refuse new items, let the queued ones run, stop the threads (joined if `wait`).
        Idempotent."""
        with self._lock:
            if self._shutdown:
                return
            self._shutdown = True
            threads = list(self._threads)
            self._wake_all(len(threads))
        if wait:
            for thread in threads:
                thread.join()


class JobPool(_Threads):
    """A fixed-size pool of daemon threads running `fn(*args)` calls in submission order: the
    subset of `concurrent.futures.ThreadPoolExecutor` a tier needs, without a `Future`, its
    condition variable and the executor's per-submit locks (the per-job Python a small chunk
    pays under GIL contention). All `threads` threads start with the first call; if
    one cannot start, that call is refused (RuntimeError) and the next one tries again.
    Exceptions escaping `fn` are swallowed (`JobBoard` catches its own first).

    Args:
        threads: Number of worker threads (> 0).
        name: Thread name prefix ("kvhal-obj-load" → "kvhal-obj-load_0", ...).
    """

    def __init__(self, threads: int, name: str):
        super().__init__(name, (threads,), "{name}_{i}", threading.Lock())
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue `fn(*args)`.

        Raises:
            RuntimeError: the pool was shut down, or a thread could not start (nothing queued).
        """
        with self._lock:
            self._admit()
            self._queue.put((fn, args))

    def _work(self, group: int) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args = item
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - a job's own errors are its caller's to report
                pass

    def _wake_all(self, threads: int) -> None:
        for _ in range(threads):
            self._queue.put(None)


class LanePool(_Threads):
    """Two queues served in batches by two groups of threads: lane 0 (a tier's loads, on the
    path to a request's first token) and lane 1 (its stores, in the background). Group 0's
    threads take only loads; group 1's take stores and, while no store is queued, loads too.
    So every thread reads when nothing is stored, as in vLLM's fs tier (`DualQueueThreadPool`,
    `vllm/v1/kv_offload/tiering/fs/thread_pool.py`, whose 16 + 16 threads all read while no
    store is queued), and the load threads never run a store: a store, once its chunk is in
    host memory, has no request waiting on it, and buffered writes on every thread were slower
    than on the store threads alone (README "fs tier I/O mode").

    A thread takes the next item of a lane and, while that lane holds more items than there
    are threads taking from it (lane 1: group 1; lane 0: both groups while no store is
    queued, else group 0), up to `max_batch - 1` more, so a deep queue costs one `run` call
    (one GIL release in the fs tier's C helper) per batch while a shallow one still keeps
    every thread busy with single items. All threads start with the first item; if one cannot
    start, that item is refused (RuntimeError) and the next item tries again.

    Args:
        threads: (group 0 threads, group 1 threads), each > 0.
        name: Thread name prefix ("kvhal-fs" → "kvhal-fs_l0_0", ..., "kvhal-fs_l1_0", ...).
        runs: `runs[i]` is called with a non-empty list of lane i's items; exceptions escaping
            it are swallowed (`JobBoard.run_batch` reports its own errors).
        max_batch: Most items per call (>= 1).

    Raises:
        ValueError: a thread count below 1 or `max_batch` below 1.
    """

    def __init__(self, threads: tuple[int, int], name: str,
                 runs: tuple[Callable[[list], Any], Callable[[list], Any]], max_batch: int):
        if len(threads) != 2 or min(threads) < 1 or max_batch < 1:
            raise ValueError(f"{name}: threads must be two counts >= 1 and max_batch >= 1 "
                             f"(got threads={threads!r}, max_batch={max_batch!r})")
        lock = threading.Lock()
        super().__init__(name, tuple(threads), "{name}_l{group}_{i}", lock)
        self._runs, self._max_batch = runs, max_batch
        self._queues: tuple[collections.deque, collections.deque] = (collections.deque(),
                                                                     collections.deque())
        #: One condition per group, on one lock; `_idle[g]`: group g's threads waiting and not
        #: yet woken (a put wakes one, preferring group 0 for a load).
        self._wake = (threading.Condition(lock), threading.Condition(lock))
        self._idle = [0, 0]
        #: The two lanes: `lanes[i].submit(item)` queues an item for `runs[i]`.
        self.lanes = (Lane(self, 0), Lane(self, 1))

    def _put(self, lane: int, item: Any) -> None:
        with self._lock:
            self._admit()
            self._queues[lane].append(item)
            group = 0 if lane == 0 and self._idle[0] else 1
            if self._idle[group]:
                self._idle[group] -= 1
                self._wake[group].notify()

    def _take(self, group: int) -> tuple[int, list] | None:
        """The next batch for a thread of `group` (lane, items), waiting for one; None once
        the pool is shut down and no item is left that the group takes. Lock held."""
        queues = self._queues
        while True:
            lane = 0 if queues[0] and (group == 0 or not queues[1]) else 1 if (
                group == 1 and queues[1]) else None
            if lane is not None:
                takers = (self._sizes[1] if lane else
                          self._sizes[0] + (0 if queues[1] else self._sizes[1]))
                todo = queues[lane]
                return lane, [todo.popleft() for _ in range(
                    1 + min(self._max_batch - 1, (len(todo) - 1) // takers))]
            if self._shutdown:
                return None
            self._idle[group] += 1
            self._wake[group].wait()

    def _work(self, group: int) -> None:
        while True:
            with self._lock:
                taken = self._take(group)
            if taken is None:
                return
            lane, batch = taken
            try:
                self._runs[lane](batch)
            except Exception:  # noqa: BLE001 - `JobBoard.run_batch` reports its own errors
                pass

    def _wake_all(self, threads: int) -> None:
        for wake in self._wake:
            wake.notify_all()


class Lane:
    """One queue of a `LanePool` (its `lanes[i]`): what `JobBoard.submit` hands a job to.

    Args:
        pool: The pool whose lane this is.
        index: 0 or 1.
    """

    def __init__(self, pool: LanePool, index: int):
        self._pool, self._index = pool, index

    def submit(self, item: Any) -> None:
        """Queue `item` for the pool's `runs[index]`.

        Raises:
            RuntimeError: the pool was shut down.
        """
        self._pool._put(self._index, item)


class JobBoard:
    """Pending and finished jobs of one tier instance, plus its counters. Thread-safe.

    Args:
        tier_name: Used in error messages ("fs tier: 3 jobs still pending ...").
    """

    def __init__(self, tier_name: str):
        self._name = tier_name
        self._cond = threading.Condition()
        self._finished: list[JobResult] = []
        self._pending = 0
        self._closed = False
        self._counters: collections.Counter[str] = collections.Counter()
        self._meters: dict[str, Any] = {}

    def meter(self, name: str, series: Any) -> None:
        """Also add every count of counter `name` to `series` (a labelled series of the tier's
        own metrics, `kvhal.tier_metrics.Metric.labels`)."""
        self._meters[name] = series

    @property
    def closed(self) -> bool:
        """True once `close` was called: new jobs fail at once with "tier closed"."""
        return self._closed

    @property
    def pending(self) -> int:
        """Jobs submitted and not yet finished."""
        with self._cond:
            return self._pending

    def submit(self, pool: JobPool | Lane, fn: JobFn | None, job: TierJob) -> None:
        """Run `fn(job)` on `pool`; its outcome becomes the job's result. On a `Lane` of a
        `LanePool` (`fn` unused: None) the job goes to that lane's function of the pool
        (`runs[index]`), which must call `run_batch` with this board. A closed board fails the
        job at once, as does a pool that refuses it (RuntimeError: shut down, or a thread could
        not start); the result is still reported exactly once."""
        with self._cond:
            if self._closed:
                self._finish(job, 0.0, "tier closed")
                return
            self._pending += 1
        try:
            if isinstance(pool, Lane):
                pool.submit(job)
            else:
                pool.submit(self._run, fn, job)
        except RuntimeError as exc:  # shut down since the check, or a thread did not start
            with self._cond:
                self._pending -= 1
                self._finish(job, 0.0, "tier closed" if self._closed else f"not run: {exc}")
                self._cond.notify_all()

    def finish(self, job: TierJob, error: str | None = None) -> None:
        """Report `job` as finished now, on the caller's thread, for a job that needs no I/O
        (e.g. a store whose chunk is already where it must be). Exactly-once as `submit`."""
        with self._cond:
            self._finish(job, 0.0, "tier closed" if self._closed else error)

    def _run(self, fn: JobFn, job: TierJob) -> None:
        t0 = time.perf_counter()
        try:
            error = fn(job)
        except Exception as exc:  # a bug must still end the job exactly once
            error = internal_error(exc)
        with self._cond:
            self._finish(job, time.perf_counter() - t0, error)
            self._pending -= 1
            if not self._pending:  # only `drain` waits, for zero: no wake-up per job
                self._cond.notify_all()

    def run_batch(self, fn: BatchFn, jobs: list[TierJob]) -> None:
        """Run `fn(jobs)` (on a `LanePool` thread) and report its outcomes as the jobs'
        results, each job with the batch's seconds; if `fn` raises, or returns another number
        of outcomes, every job of the batch fails as an internal error."""
        t0 = time.perf_counter()
        try:
            errors = fn(jobs)
            if len(errors) != len(jobs):
                raise RuntimeError(f"{len(errors)} outcomes for {len(jobs)} jobs")
        except Exception as exc:  # a bug must still end each job exactly once
            errors = [internal_error(exc)] * len(jobs)
        seconds = time.perf_counter() - t0
        with self._cond:
            for job, error in zip(jobs, errors):
                self._finish(job, seconds, error)
            self._pending -= len(jobs)
            if not self._pending:
                self._cond.notify_all()

    def _finish(self, job: TierJob, seconds: float, error: str | None) -> None:
        self._finished.append(JobResult(job.job_id, job.kind, job.key, error is None, error,
                                        seconds))
        if error is not None:
            self._counters[f"{job.kind.value}_failed"] += 1

    def take_finished(self) -> list[JobResult]:
        """Results of jobs finished since the last call, each exactly once."""
        with self._cond:
            out, self._finished = self._finished, []
            return out

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait until no job is pending.

        Raises:
            TimeoutError: jobs remain after `timeout_s` seconds.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: self._pending == 0, timeout_s):
                raise TimeoutError(f"{self._name} tier: {self._pending} jobs still pending "
                                   f"after {timeout_s} s")

    def close(self) -> bool:
        """Refuse new jobs from now on. Returns True on the first call only (the caller then
        shuts its pools down), False if already closed."""
        with self._cond:
            if self._closed:
                return False
            self._closed = True
            return True

    def count(self, name: str, n: int = 1) -> None:
        """Add `n` to counter `name` (and to its `meter`, if any)."""
        with self._cond:
            self._counters[name] += n
        series = self._meters.get(name)
        if series is not None:
            series.inc(n)

    def count_all(self, counts: "collections.Counter[str]") -> None:
        """Add every counter of `counts` (a batch's tally: one lock for the batch)."""
        with self._cond:
            self._counters.update(counts)

    def counters(self) -> dict[str, int]:
        """A copy of the counters (those still 0 are absent)."""
        with self._cond:
            return dict(self._counters)


class BoardedTier(SecondaryTier):
    """Base of tiers whose jobs run through a `JobBoard` held in `self._jobs`: implements
    `get_finished_jobs` and `drain` from it."""

    _jobs: JobBoard

    def get_finished_jobs(self) -> list[JobResult]:
        """Results of jobs finished since the last call, each exactly once."""
        return self._jobs.take_finished()

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait until no job is pending.

        Raises:
            TimeoutError: jobs remain after `timeout_s` seconds.
        """
        self._jobs.drain(timeout_s)


class IndexedTier(BoardedTier):
    """Base of tiers that answer lookups from a `ChunkIndex` in `self._index` and run stores and
    loads on `self._store_pool` / `self._load_pool` (fs, obj): implements `lookup`,
    `submit_store`, `submit_load` and `take_removed` from them; subclasses define
    `_store(job)` and `_load(job)` (None or an error string)."""

    _index: ChunkIndex
    _store_pool: JobPool | Lane
    _load_pool: JobPool | Lane

    def lookup(self, key: ChunkKey) -> Lookup:
        """HIT if the index holds `key` (no I/O; a HIT's load may still fail)."""
        return Lookup.HIT if not self._jobs.closed and key in self._index else Lookup.MISS

    def submit_store(self, job: TierJob) -> None:
        """Queue a store on the store pool (see `SecondaryTier.submit_store`)."""
        self._jobs.submit(self._store_pool, self._store, job)

    def submit_load(self, job: TierJob) -> None:
        """Queue a load on the load pool (see `SecondaryTier.submit_load`)."""
        self._jobs.submit(self._load_pool, self._load, job)

    def forget(self, keys: Sequence[ChunkKey]) -> None:
        """Drop `keys` from the index (see `SecondaryTier.forget`): each is a miss until a
        listing of the store finds it again (then it is there: a listing sees only what was
        stored whole), and its next store writes it anew, replacing a record the store still
        holds (`ChunkIndex.forget`: doubted until stored). No I/O."""
        self._index.forget(keys)

    def watch(self, on_change: Callable[[], None]) -> None:
        """Call `on_change` after each listing that added or dropped keys (see
        `SecondaryTier.watch`)."""
        self._index.on_change = on_change

    def take_found(self) -> list[tuple[ChunkKey, bytes | None]]:
        """Keys a listing of the store added to the index since the last call (at start: what
        the store held), without descriptions (see `SecondaryTier.take_found`)."""
        return [(key, None) for key in self._index.take_found()]

    def take_removed(self) -> list[ChunkKey]:
        """Keys that left the index since the last call, each once: evicted, found corrupt or
        missing by a load, forgotten after a failed load (`forget`), or gone from a listing
        (deleted by another process)."""
        return self._index.take_removed()
