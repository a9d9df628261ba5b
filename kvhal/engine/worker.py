"""The worker (DESIGN §5): runs store (D2H) and load (H2D) jobs through the device HAL.

Each job moves whole chunks between device blocks and host slots. A planner turns one chunk
(its device block ids and its host slot address) into a `CopyPlan` for the given direction, so
the worker does not know the layout. Stores run on a dedicated store stream, loads on a
dedicated load stream; a store first makes its stream wait on the caller's event recorded after
the compute that produced the KV, so it never copies KV before it is written; the compute that
reads loaded KV orders itself after the load with `stream_wait_job` (a stream wait, the host
does not block) or `wait` (the host blocks).

A job is planned in one call when the planner offers `plan_job` (`JobPlanner`), else chunk by
chunk, then issued together: every 2D copy, then one `copy_batch_async` for all contiguous
copies, then one event (few HAL calls per job, so the issuing thread does not compete with the
copies). A job is finished when that event completes; its device blocks are then free (stores)
or hold the KV (loads). A sub-transfer that fails fails its chunk and every later chunk of the
job — `num_ok` counts only the leading chunks that fully arrived, so wrong bytes are never
reported as loaded:
- a chunk the planner refuses (found by planning chunk by chunk when `plan_job` refuses the
  job), or a batch the backend refuses when issued (`HalError`), is found by issuing chunk by
  chunk (one event per chunk); the first refused chunk ends the job;
- a fault on the device (`DeviceFaultError` at the job's event) replays the job chunk by chunk
  (its blocks and slots are still reserved, so copying them again is harmless) and the first
  chunk whose event faults ends it; a transient fault that does not recur costs only time.

Threading: one thread (the engine worker's) calls every method.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from kvhal.hal import DeviceBackend, DeviceFaultError, Event, HalError, Stream
from kvhal.layout.plan import CopyPlan, merge_plans

from .types import Direction, EngineError, TransferResult

_CANCELLED = "cancelled"


class Planner(Protocol):
    """Turns one chunk into the HAL copies that move it.

    Args (of the call):
        block_ids: int64 array (blocks_per_chunk,): the chunk's device block ids, in order.
        slot_addr: Address of the chunk's host slot (bytes).
        direction: D2H (device blocks → slot) or H2D (slot → device blocks).

    Returns:
        A `CopyPlan` whose copies move exactly the chunk's bytes.

    Raises:
        ValueError (e.g. `LayoutError`) or `HalError`: the chunk cannot be planned; the worker
        fails the chunk and the rest of its job.
    """

    def __call__(self, block_ids: np.ndarray, slot_addr: int, direction: Direction
                 ) -> CopyPlan: ...


class JobPlanner(Planner, Protocol):
    """A `Planner` that can also plan a whole job in one call (the worker prefers it).

    Args (of `plan_job`):
        block_ids: int64 array (n, blocks_per_chunk): chunk i's device block ids, in order.
        slot_addrs: int64 array (n,): address of chunk i's host slot (bytes).
        direction: D2H or H2D.

    Returns:
        One `CopyPlan` with exactly the copies of the n per-chunk calls, merged in chunk order
        (`kvhal.layout.plan.merge_plans`).

    Raises:
        ValueError or `HalError`: some chunk cannot be planned; the worker then plans chunk by
        chunk to find the first one.
    """

    def plan_job(self, block_ids: np.ndarray, slot_addrs: np.ndarray, direction: Direction
                 ) -> CopyPlan: ...


@dataclass(slots=True)
class _Job:
    job_id: int
    direction: Direction
    block_ids: np.ndarray
    slot_addrs: np.ndarray
    num_planned: int               # leading chunks that could be planned (and issued)
    plans: list[CopyPlan] | None   # per-chunk plans; None while the job was planned as one
    tail: Event | None = None      # recorded after everything issued for the job
    events: list[Event] | None = None  # per-chunk events when issued chunk by chunk
    issue_error: str | None = None
    cancelled: bool = field(default=False)


class Worker:
    """Runs transfer jobs on a store stream and a load stream of `backend`.

    Args:
        backend: The device HAL backend.
        planner: Chunk → `CopyPlan` (see `Planner`); with `plan_job` (`JobPlanner`), a whole
            job is planned in one call.
        host_ptr: Address of host slot 0 (the host region's base).
        slot_bytes: Bytes per host slot.
        device: Device ordinal for the streams.
    """

    def __init__(self, backend: DeviceBackend, planner: Planner | Callable[..., CopyPlan], *,
                 host_ptr: int, slot_bytes: int, device: int = 0):
        self.backend = backend
        self.planner = planner
        self.host_ptr = host_ptr
        self.slot_bytes = slot_bytes
        self._streams = {Direction.D2H: backend.create_stream(device),
                         Direction.H2D: backend.create_stream(device)}
        self._inflight: dict[Direction, collections.deque[_Job]] = {
            d: collections.deque() for d in Direction}
        self._by_id: dict[int, _Job] = {}
        self._spare_events: list[Event] = []
        self._finished: list[TransferResult] = []

    # -- submission --------------------------------------------------------------------------
    def submit_store(self, job_id: int, block_ids: np.ndarray, slots: np.ndarray, *,
                     after: Event | None = None) -> None:
        """Copy chunks device → host: chunk i's blocks `block_ids[i]` into host slot `slots[i]`.

        Args:
            job_id: From `StorePlan.job_id`; unique among open jobs.
            block_ids: int array (n, blocks_per_chunk) of device block ids.
            slots: int array (n,) of host slots.
            after: Event the caller recorded on its compute stream after the kernels that
                wrote these blocks; the store stream waits on it (None: the KV is already
                complete, e.g. written by a synchronised stream).

        Raises:
            EngineError: duplicate job id or mismatched shapes (nothing is issued).
        """
        self._submit(Direction.D2H, job_id, block_ids, slots, after)

    def submit_load(self, job_id: int, block_ids: np.ndarray, slots: np.ndarray, *,
                    after: Event | None = None) -> None:
        """Copy chunks host → device: host slot `slots[i]` into device blocks `block_ids[i]`.

        Args and errors as `submit_store`; `after` orders the load behind e.g. the caller's
        last use of the destination blocks.
        """
        self._submit(Direction.H2D, job_id, block_ids, slots, after)

    def _submit(self, direction: Direction, job_id: int, block_ids: np.ndarray,
                slots: np.ndarray, after: Event | None) -> None:
        block_ids = np.asarray(block_ids, dtype=np.int64)
        slots = np.asarray(slots, dtype=np.int64)
        if block_ids.ndim != 2 or slots.shape != (block_ids.shape[0],):
            raise EngineError(f"job {job_id}: block_ids must be (n, blocks_per_chunk) and slots "
                              f"(n,), got {block_ids.shape} and {slots.shape}")
        if job_id in self._by_id:
            raise EngineError(f"job {job_id} is already in flight")
        slot_addrs = slots * self.slot_bytes + self.host_ptr
        plan_job = getattr(self.planner, "plan_job", None)
        plans, error = None, None
        if plan_job is not None:
            try:
                merged = plan_job(block_ids, slot_addrs, direction)
            except (HalError, ValueError):
                plan_job = None  # plan chunk by chunk to find the first refused chunk
        if plan_job is None:
            plans, error = self._plan_chunks(direction, block_ids, slot_addrs)
            merged = merge_plans(plans)
        job = _Job(job_id, direction, block_ids, slot_addrs,
                   len(slots) if plans is None else len(plans), plans, issue_error=error)
        if after is not None:
            self.backend.stream_wait_event(self._streams[direction], after)
        try:
            _issue(self.backend, merged, self._streams[direction])
        except HalError:
            self._issue_per_chunk(job)
        else:
            job.tail = self._record(direction)
        self._inflight[direction].append(job)
        self._by_id[job_id] = job

    def _plan_chunks(self, direction: Direction, block_ids: np.ndarray, slot_addrs: np.ndarray
                     ) -> tuple[list[CopyPlan], str | None]:
        """Plan chunk by chunk: the plans of the leading chunks the planner accepts, and the
        error of the first one it refuses (None if none)."""
        plans: list[CopyPlan] = []
        for c in range(len(slot_addrs)):
            try:
                plans.append(self.planner(block_ids[c], int(slot_addrs[c]), direction))
            except (HalError, ValueError) as exc:
                return plans, f"chunk {c}: {exc}"
        return plans, None

    def _issue_per_chunk(self, job: _Job) -> None:
        """Issue the job's planned chunks one at a time with an event after each (planning
        them chunk by chunk first if the job was planned as one); a chunk refused at issue
        ends the job there."""
        if job.plans is None:
            job.plans, error = self._plan_chunks(job.direction, job.block_ids[:job.num_planned],
                                                 job.slot_addrs[:job.num_planned])
            job.issue_error = job.issue_error or error
        job.events = []
        for i, plan in enumerate(job.plans):
            try:
                _issue(self.backend, plan, self._streams[job.direction])
            except HalError as exc:
                job.issue_error = f"chunk {i}: {exc}"
                del job.plans[i:]
                break
            job.events.append(self._record(job.direction))
        job.num_planned = len(job.plans)
        job.tail = self._record(job.direction)

    def _record(self, direction: Direction) -> Event:
        event = self._event()
        self.backend.record_event(event, self._streams[direction])
        return event

    def _event(self) -> Event:
        return self._spare_events.pop() if self._spare_events else self.backend.create_event()

    # -- completion --------------------------------------------------------------------------
    def get_finished(self) -> list[TransferResult]:
        """Results of jobs finished since the last call (each job exactly once). Never blocks
        (except to replay a job chunk by chunk after a device fault)."""
        for direction in Direction:
            queue = self._inflight[direction]
            while queue and self.backend.event_query(queue[0].tail):
                self._finish(queue.popleft())
        out, self._finished = self._finished, []
        return out

    def _finish(self, job: _Job) -> None:
        """Judge a job whose tail event completed: report it, or replay it after a fault."""
        backend = self.backend
        num_ok, error = job.num_planned, job.issue_error
        faulted, merged = False, job.events is None
        for i, event in enumerate([job.tail] if merged else job.events):
            try:
                backend.event_synchronize(event)
            except DeviceFaultError as exc:
                faulted, num_ok, error = True, i, f"chunk {i}: {exc}"
                break
        if faulted:
            try:  # clear the stream's sticky error so later work is judged on its own
                backend.stream_synchronize(self._streams[job.direction])
            except DeviceFaultError:
                pass
        self._recycle(job)
        if faulted and merged and not job.cancelled:
            self._issue_per_chunk(job)         # find the faulting chunk; judged again later
            self._inflight[job.direction].append(job)
            return
        if job.cancelled:
            num_ok, error = 0, _CANCELLED
        del self._by_id[job.job_id]
        self._finished.append(TransferResult(job.job_id, job.direction, len(job.block_ids),
                                             num_ok, job.block_ids, error))

    def _recycle(self, job: _Job) -> None:
        self._spare_events.extend(job.events or ())
        self._spare_events.append(job.tail)
        job.events, job.tail = None, None

    def cancel(self, job_id: int) -> None:
        """Make an in-flight job end as failed ("cancelled", num_ok 0). Its copies already
        issued still run: its device blocks stay fenced until its last event completes.

        Raises:
            EngineError: `job_id` is not in flight.
        """
        job = self._by_id.get(job_id)
        if job is None:
            raise EngineError(f"job {job_id} is not in flight")
        job.cancelled = True

    def fenced_blocks(self) -> np.ndarray:
        """Sorted unique int64 device block ids that in-flight jobs still read or write: they
        must not be reused until `wait_blocks` returns or their job is reported finished."""
        jobs = list(self._by_id.values())
        if not jobs:
            return np.empty(0, dtype=np.int64)
        return np.unique(np.concatenate([j.block_ids.ravel() for j in jobs]))

    def wait_blocks(self, block_ids: np.ndarray) -> None:
        """Block until no in-flight job uses any of `block_ids` (e.g. before a preempted
        request's blocks are reused). Results stay queued for `get_finished`."""
        wanted = np.asarray(block_ids, dtype=np.int64).ravel()
        for job in list(self._by_id.values()):
            if np.isin(job.block_ids, wanted).any():
                self._wait_job(job)

    def stream_wait_job(self, stream: Stream, job_id: int) -> None:
        """Make `stream` (e.g. the engine's compute stream) wait for every copy of job
        `job_id` issued so far, without blocking the host: a stream wait on the job's tail
        event, bound to its current record (so recycling the event later is harmless).

        The job still ends exactly once, through `get_finished` or `wait`, and its host slots
        and device blocks stay reserved until then. A job not in flight has ended (or never
        began): there is nothing to wait for. After a device fault the job is replayed on
        its own stream, which `stream` does not wait for: the fault fails the job, so its
        blocks are reported and never served.
        """
        job = self._by_id.get(job_id)
        if job is not None:
            self.backend.stream_wait_event(stream, job.tail)

    def wait(self, job_id: int | None = None) -> None:
        """Block until job `job_id` (None: every job) has finished. Results stay queued."""
        jobs = list(self._by_id.values()) if job_id is None else [self._by_id.get(job_id)]
        for job in jobs:
            if job is not None:
                self._wait_job(job)

    def _wait_job(self, job: _Job) -> None:
        queue = self._inflight[job.direction]
        while job.job_id in self._by_id:
            head = queue.popleft()
            try:
                self.backend.event_synchronize(head.tail)
            except DeviceFaultError:
                pass  # judged in _finish
            self._finish(head)

    def close(self) -> None:
        """Wait for every job, then release streams and events (results stay queued)."""
        self.wait()
        for stream in self._streams.values():
            self.backend.destroy_stream(stream)
        for event in self._spare_events:
            self.backend.destroy_event(event)
        self._spare_events.clear()


def _issue(backend: DeviceBackend, plan: CopyPlan, stream) -> None:
    """The 2D copies of `plan` as one batch, then its contiguous copies as one batch."""
    if len(plan.copies_2d):
        backend.copy_2d_batch_async(plan.copies_2d, stream)
    if len(plan.sizes):
        backend.copy_batch_async(plan.dsts, plan.srcs, plan.sizes, stream)
