"""Store planning: which full chunks of a request are due for storing, in order and without a
gap (the stored-chunk cursor, `StorePlanner.plan`), the states vLLM hands over at chunk
boundaries (`StorePlanner.plan_state_stores`; state groups: `loads` module docstring), and the
chunks that are due but will never be stored (`StorePlanner.skip`)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from kvhal.config import EngineConfig
from kvhal.engine import Manager, chunks_to_store
from kvhal.layout import Kind

from ..events import ChunkEvents
from ..geometry import Deployment
from ..metadata import TransferJob
from .counters import SideCounters
from .jobs import InFlightJobs, Job
from .requests import RequestState, RequestTable, VllmBlocks


class StorePlanner:
    """Plans the store jobs of each step and of finishing requests.

    Args:
        deployment: Geometry and KV cache groups.
        config: The kvhal config (`offload_prompt_only`).
        manager: The engine's manager (host slots for stores).
        requests: The live requests (chunk keys).
        jobs: Where shipped store jobs are tracked.
        counters: The connector's counters (`store_skipped_chunks`).
        blocks: vLLM's block table.
        chunk_events: Where stored chunks are described for KV events, or None.
    """

    def __init__(self, deployment: Deployment, config: EngineConfig, manager: Manager,
                 requests: RequestTable, jobs: InFlightJobs, counters: SideCounters,
                 blocks: VllmBlocks, chunk_events: ChunkEvents | None):
        self._deployment = deployment
        self._offload_prompt_only = config.offload_prompt_only
        self._manager = manager
        self._requests = requests
        self._jobs = jobs
        self._counters = counters
        self._blocks = blocks
        self._chunk_events = chunk_events
        self._state_groups = {g.group_id for g in deployment.groups if g.kind is Kind.MAMBA}
        self._pending: list[TransferJob] = []   # planned by `finish_request`, for the next step
        self._report_sending: list[str] = []    # finished requests whose stores read blocks

    def take_pending(self) -> tuple[list[TransferJob], tuple[str, ...]]:
        """The stores `finish_request` planned since the last step, and the requests it found
        with stores in flight (their blocks' free is delayed until the workers report them)."""
        stores, self._pending = self._pending, []
        report, self._report_sending = tuple(self._report_sending), []
        return stores, report

    def finish_request(self, state: RequestState, num_computed_tokens: int) -> None:
        """The request of `state` finished with `num_computed_tokens` computed: plan what is
        still due (stored in the next step); count what finds no host slot as skipped."""
        jobs, unplaced = self.plan(state, num_computed_tokens, num_computed_tokens)
        self._pending.extend(jobs)
        for group, num_chunks in unplaced.items():
            self.skip(group, num_chunks)

    def delay_free(self, request_id: str) -> None:
        """Report the request to the workers as finished with stores in flight."""
        self._report_sending.append(request_id)

    def plan(self, state: RequestState, num_computed_tokens: int, num_done_tokens: int
                    ) -> tuple[list[TransferJob], dict[int, int]]:
        """Store jobs for the full chunks of `state`'s request that are due: vLLM held
        `num_computed_tokens` of its tokens before the step, `num_done_tokens` after it; and
        per group, the due chunks it could not place (from the first that found no free host
        slot on), {group: chunks}.

        A chunk is due from the step that completes it until it is placed (`prepare_store`
        reserved its host slot) or kvhal holds it already: the stored-chunk cursor
        (`RequestState.num_stored_chunks`) moves only past those, and never past the first chunk
        some group could not place (the host tier had no free slot), so that chunk and the
        ones after it are due again in the next step that schedules the request (or in
        `finish_request`), and the chunks kvhal stores of a prefix never have a gap. A chunk
        a sliding window already dropped (a null block) is never stored.

        The cursor never stays ahead of what vLLM holds: where vLLM goes back below it, it
        computes those chunks again and they are due again. That happens after an asynchronous
        load was cut back to the chunk that failed (`LoadPlanner.settle`; the chunks before it were
        loaded, so they are in host memory and stay behind the cursor), after vLLM rolled a
        failed synchronous load back to its first invalid block (the step after the failure;
        the stores of the failing step that read a failed chunk were not committed,
        `LoadPlanner.sync_reads`), and when a preempted request is admitted again with a shorter hit than
        it had stored. `Manager.prepare_store` skips the due chunks kvhal still holds, those
        being stored included (they are in its index): no chunk is stored twice at once.
        """
        request, dep = state.request, self._deployment
        state.num_stored_chunks = min(state.num_stored_chunks,
                                      num_computed_tokens // dep.tokens_per_chunk)
        if self._offload_prompt_only:
            num_done_tokens = min(num_done_tokens, request.num_prompt_tokens)
        bpc = dep.blocks_per_chunk
        due = chunks_to_store(num_done_tokens, state.num_stored_chunks, dep.tokens_per_chunk,
                              state.max_offload_tokens)
        due = range(due.start, min(due.stop, len(request.block_hashes) // bpc))
        if not due:
            return [], {}
        group_blocks = self._blocks.kv_cache_manager.get_block_ids(request.request_id)
        jobs, unplaced, cursor = [], {}, due.stop
        for g in dep.groups:
            if g.group_id in self._state_groups:   # stored as vLLM hands states over
                continue
            keys = self._requests.keys(request, g.group_id)
            ids = np.asarray(group_blocks[g.group_id], dtype=np.int64)
            chunks = np.arange(due.start, due.stop, dtype=np.int64)
            blocks = ids[(chunks[:, None] * bpc + np.arange(bpc)).ravel()].reshape(-1, bpc)
            held = (blocks != self._blocks.null_block_id).all(axis=1)  # a window may have dropped some
            chunks, blocks = chunks[held], blocks[held]
            due_keys = [keys[c] for c in chunks]
            plan = self._manager.prepare_store(due_keys, request_id=request.request_id)
            placed = self._manager.num_held(due_keys)
            if placed < len(chunks):               # no free slot for it: still due
                cursor = min(cursor, int(chunks[placed]))
                # (later chunks placed meanwhile are being stored: not unplaced)
                unplaced[g.group_id] = sum(not self._manager.num_held([key])
                                           for key in due_keys[placed:])
            if plan is None:
                continue
            if self._chunk_events is not None:
                for key, chunk in zip(plan.keys, chunks[plan.indices].tolist()):
                    self._chunk_events.record(key, request, chunk)
            self._jobs.add(Job(plan.job_id, request.request_id, True, g.group_id,
                               chunks[plan.indices]))
            state.store_jobs.add(plan.job_id)
            jobs.append(TransferJob(plan.job_id, request.request_id, g.group_id, plan.slots,
                                    blocks[plan.indices]))
        state.num_stored_chunks = cursor
        return jobs, unplaced

    def skip(self, group: int, num_chunks: int) -> None:
        """Count `num_chunks` chunks of `group` that were due but will never be stored (their
        request ended, or a state's block is gone, before a host slot was free)."""
        self._counters.add("store_skipped_chunks", group, num_chunks)
        self._manager.skip_store(num_chunks)

    def plan_state_stores(self, state: RequestState, entries: Sequence[tuple[int, int, int]]
                          ) -> list[TransferJob]:
        """Store jobs for the states vLLM handed over this step (`entries`: (group, block id,
        boundary tokens) from `boundary_state_offloads`): a state at a chunk boundary within
        what the request may offload (its prompt with `offload_prompt_only`, its
        `max_offload_tokens`) becomes that chunk of its group; others are skipped. A state
        that finds no free host slot is counted as skipped (`skip`): its block leaves the
        request's table, so it is never due again. Nothing without a state group."""
        if not self._state_groups:
            return []
        request, dep = state.request, self._deployment
        tpc = dep.tokens_per_chunk
        limit = (request.num_prompt_tokens if self._offload_prompt_only
                 else request.num_tokens)
        if state.max_offload_tokens is not None:
            limit = min(limit, state.max_offload_tokens)
        limit = min(limit, len(request.block_hashes) * dep.block_size)
        jobs = []
        for group, block_id, boundary in entries:
            if (group not in self._state_groups or block_id == self._blocks.null_block_id
                    or boundary <= 0 or boundary % tpc or boundary > limit):
                continue
            chunk = boundary // tpc - 1
            key = self._requests.keys(request, group)[chunk]
            plan = self._manager.prepare_store([key], request_id=request.request_id)
            if plan is None:
                if not self._manager.num_held([key]):
                    self.skip(group, 1)
                continue
            if self._chunk_events is not None:
                self._chunk_events.record(key, request, chunk)
            self._jobs.add(Job(plan.job_id, request.request_id, True, group,
                               np.array([chunk], np.int64)), state_block=block_id)
            state.store_jobs.add(plan.job_id)
            jobs.append(TransferJob(plan.job_id, request.request_id, group, plan.slots,
                                    np.array([[block_id]], np.int64)))
        return jobs
