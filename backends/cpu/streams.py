"""Streams and events of the cpu backend: one worker thread per stream, FIFO order.

An event record is a `Mark` queued into a stream; it completes (and takes its timestamp) when
the stream's worker reaches it. `stream_wait_event` queues a wait on the mark that was current
when it was called, which is CUDA's semantics. Chaos mode sleeps a seeded random time before
each operation so that a missing wait shows up as wrong bytes.
"""
from __future__ import annotations

import queue
import random
import threading
import time
from typing import Callable

from kvhal.hal import InvalidValueError

#: Chaos delays are uniform in [0, CHAOS_MAX_DELAY_S] seconds, applied to half the operations.
CHAOS_MAX_DELAY_S = 0.002


class Mark:
    """One record of an event: completes when its stream reaches it."""

    __slots__ = ("done", "time_ns", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.time_ns = 0
        self.error: BaseException | None = None


class EventState:
    """Backend-private state of an `Event`: the mark of its most recent record."""

    __slots__ = ("mark",)

    def __init__(self) -> None:
        self.mark: Mark | None = None


class StreamWorker:
    """A daemon thread that runs queued callables in FIFO order.

    The first exception an operation raises is kept and re-raised (wrapped by the backend) at
    the next synchronisation; operations after it still run, as on a GPU stream. After `close`
    every `submit` raises `InvalidValueError` (work queued behind the stop would never run).
    """

    def __init__(self, name: str, chaos_seed: int | None, backend: str = "cpu"):
        self.name = name
        self._backend = backend
        self._closed = False
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._rng = random.Random(chaos_seed) if chaos_seed is not None else None
        self._submitted = 0
        self._completed = 0
        self._cond = threading.Condition()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, op: Callable[[], None]) -> None:
        """Queue `op` behind everything submitted before it.

        Raises:
            InvalidValueError: the stream is closed.
        """
        with self._cond:
            if self._closed:
                raise InvalidValueError(f"stream {self.name} was destroyed", arg="stream",
                                        backend=self._backend)
            self._submitted += 1
            self._queue.put(op)

    def _run(self) -> None:
        while True:
            op = self._queue.get()
            if op is None:
                return
            if self._rng is not None and self._rng.random() < 0.5:
                time.sleep(self._rng.uniform(0.0, CHAOS_MAX_DELAY_S))
            try:
                op()
            except BaseException as exc:  # noqa: BLE001 - kept and surfaced at sync
                if self.error is None:
                    self.error = exc
            with self._cond:
                self._completed += 1
                self._cond.notify_all()

    def idle(self) -> bool:
        """True if every submitted operation has completed."""
        with self._cond:
            return self._completed == self._submitted

    def synchronize(self) -> None:
        """Block until every operation submitted so far has completed."""
        with self._cond:
            target = self._submitted
            while self._completed < target:
                self._cond.wait()

    def record(self, state: EventState) -> None:
        """Queue a new mark for `state` (replacing its previous one once it is queued: if the
        stream is closed, `submit` raises and the event keeps its previous mark)."""
        mark = Mark()

        def complete() -> None:
            mark.error = self.error
            mark.time_ns = time.perf_counter_ns()
            mark.done.set()

        self.submit(complete)
        state.mark = mark

    def wait_for(self, mark: Mark) -> None:
        """Queue a wait: later operations run only after `mark` completes."""
        self.submit(mark.done.wait)

    def close(self) -> None:
        """Refuse new work, drain the queue and stop the thread. Closing twice is a no-op."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._thread.join()
