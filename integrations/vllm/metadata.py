"""What the connector's scheduler side tells its workers each step, and what they answer.

Both cross a process boundary (vLLM pickles them), so they hold plain values and numpy arrays.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorMetadata,
                                                               KVConnectorWorkerMetadata)

from kvhal.host import HostLayout


@dataclass(frozen=True, slots=True)
class RegionInfo:
    """Where the shared host region lives (`HostRegion.share_path`) and how it is cut: one pool
    of slots per KV cache group (`kvhal.host.HostLayout`)."""

    share_path: str
    layout: HostLayout


@dataclass(frozen=True, slots=True)
class TransferJob:
    """Chunks of one KV cache group to move between device blocks and host slots.

    Attributes:
        job_id: The manager's job id (`StorePlan.job_id` / `LoadPlan.job_id`); -1 for a load
            of which no chunk could be held (every chunk fails).
        req_id: vLLM request id the blocks belong to.
        group: KV cache group (= host pool) of the chunks.
        slots: int64 (n,): global host slot of each chunk (-1: not held, fails).
        block_ids: int64 (n, blocks_per_chunk): device block ids of each chunk, in order.
    """

    job_id: int
    req_id: str
    group: int
    slots: np.ndarray
    block_ids: np.ndarray


@dataclass
class KVHalMetadata(KVConnectorMetadata):
    """Scheduler → workers, one per step.

    Attributes:
        region: The host region (workers attach on first use).
        loads: Jobs to finish before this step's forward (H2D; vLLM's synchronous loads).
        stores: Jobs to start after this step's forward (D2H).
        async_loads: Chunks of asynchronous loads (vLLM's WAITING_FOR_REMOTE_KVS) that landed
            in host memory since the last step; they never hold up this step's forward.
        recv_final: Requests whose asynchronous load gets no more jobs: report each in
            `finished_recving` once this worker's jobs for it have finished.
        flush: Blocks were freed by preemption this step: wait for every in-flight store
            before the forward overwrites them.
        report_sending: Requests whose frees vLLM delayed; report each in `finished_sending`
            once this worker has no store reading its blocks.
    """

    region: RegionInfo
    loads: list[TransferJob] = field(default_factory=list)
    stores: list[TransferJob] = field(default_factory=list)
    flush: bool = False
    report_sending: tuple[str, ...] = ()
    async_loads: list[TransferJob] = field(default_factory=list)
    recv_final: tuple[str, ...] = ()


@dataclass
class KVHalWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers → scheduler: jobs finished on how many ranks, and how many chunks arrived.

    Attributes:
        ranks_done: job id → number of ranks that finished it.
        num_ok: job id → leading chunks that arrived on every rank that finished it.
    """

    ranks_done: dict[int, int] = field(default_factory=dict)
    num_ok: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KVHalWorkerMetadata":
        """Sum rank counts and keep the smallest `num_ok` per job (vLLM calls this across
        ranks within one step)."""
        assert isinstance(other, KVHalWorkerMetadata)
        done = dict(self.ranks_done)
        ok = dict(self.num_ok)
        for job, n in other.ranks_done.items():
            done[job] = done.get(job, 0) + n
            ok[job] = min(ok.get(job, other.num_ok[job]), other.num_ok[job])
        return KVHalWorkerMetadata(done, ok)
