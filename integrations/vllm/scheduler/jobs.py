"""The jobs the scheduler side shipped to the workers and what relates them, until every TP
rank has finished each one.

Three relations decide whether a finished job's chunks may be committed:
- a state store reads a vLLM block that vLLM may give to new use before the store ends
  (`state_blocks`: the loads module fences the step that does);
- a store of a step reads chunks a synchronous load of the same step wrote: if that load
  fails, vLLM learns of it only after the step, so the store's chunks are wrong and the store
  is judged failed (num_ok 0) when it finishes (`read_sync_loads`);
- a store that read a failed chunk stays tainted until it finishes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..metadata import KVHalWorkerMetadata


@dataclass(slots=True)
class Job:
    """A store or load job of one request and one KV cache group in flight on the workers.

    Attributes:
        chunks: int64 (n,): the request's chunk index of each job chunk, in job order.
        ranks_done: TP ranks that have finished it.
        num_ok: The smallest `num_ok` any rank reported (None before the first report).
    """

    job_id: int
    request_id: str
    is_store: bool
    group: int
    chunks: np.ndarray
    ranks_done: int = 0
    num_ok: int | None = None

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)


class InFlightJobs:
    """Jobs shipped to the workers and not finished by every TP rank yet, and their relations
    (module docstring).

    Args:
        tp_size: TP ranks that each finish every job.
    """

    def __init__(self, tp_size: int):
        self._tp_size = tp_size
        self._jobs: dict[int, Job] = {}
        # in-flight state store job → the vLLM block it reads (freed mid-request by vLLM)
        self._state_blocks: dict[int, int] = {}
        # synchronous load job → [(store job of its step, leading load chunks it reads)]
        self._sync_readers: dict[int, list[tuple[int, int]]] = {}
        # store job → the synchronous load jobs of its step whose chunks it reads
        self._store_reads: dict[int, list[int]] = {}
        self._tainted_stores: set[int] = set()   # read a chunk whose load failed: num_ok 0

    def __getitem__(self, job_id: int) -> Job:
        return self._jobs[job_id]

    def __len__(self) -> int:
        """Jobs in flight."""
        return len(self._jobs)

    def add(self, job: Job, state_block: int | None = None) -> None:
        """Track `job`; a state store names the vLLM block it reads (`state_block`)."""
        self._jobs[job.job_id] = job
        if state_block is not None:
            self._state_blocks[job.job_id] = state_block

    def read_sync_loads(self, store_job_id: int, reads: Sequence[tuple[int, int]]) -> None:
        """Store `store_job_id` reads the first `need` chunks of each synchronous load job of
        its step in `reads` ([(load job id, need)]): it fails unless they all load."""
        for load_id, need in reads:
            self._sync_readers.setdefault(load_id, []).append((store_job_id, need))
            self._store_reads.setdefault(store_job_id, []).append(load_id)

    def state_blocks(self) -> set[int]:
        """vLLM blocks that state stores in flight still read."""
        return set(self._state_blocks.values())

    def finish(self, worker_meta: KVHalWorkerMetadata) -> list[Job]:
        """Count the ranks that finished each job in `worker_meta`; return the jobs every rank
        has now finished, loads first, each with its judged `num_ok` (0 for a store that read
        a failed chunk of a synchronous load, or one whose load is not judged yet)."""
        finished = []
        # loads first: a store reading a synchronous load of its step is judged after it
        for job_id, ranks in sorted(worker_meta.ranks_done.items(),
                                    key=lambda item: self._jobs[item[0]].is_store):
            job = self._jobs[job_id]
            job.ranks_done += ranks
            ok = worker_meta.num_ok[job_id]
            job.num_ok = ok if job.num_ok is None else min(job.num_ok, ok)
            if job.ranks_done < self._tp_size:
                continue
            del self._jobs[job_id]
            self._judge(job)
            finished.append(job)
        return finished

    def _judge(self, job: Job) -> None:
        job_id = job.job_id
        self._state_blocks.pop(job_id, None)
        for store_id, need in self._sync_readers.pop(job_id, ()):
            if job.num_ok < need:
                self._tainted_stores.add(store_id)
        reads = self._store_reads.pop(job_id, ())
        if job_id in self._tainted_stores or any(r in self._sync_readers for r in reads):
            self._tainted_stores.discard(job_id)   # (a load not judged yet counts as failed)
            job.num_ok = 0
