"""Values that cross between the manager, the worker and an integration."""
from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from kvhal.keys import ChunkKey


class EngineError(RuntimeError):
    """Misuse of the engine API (unknown or already completed job, bad shapes); names the value."""


class Direction(enum.Enum):
    """D2H: device → host (a store). H2D: host → device (a load)."""

    D2H = "d2h"
    H2D = "h2d"


@dataclass(frozen=True, slots=True)
class StorePlan:
    """Chunks the manager reserved host slots for (`Manager.prepare_store`).

    Attributes:
        job_id: Identifies the job in `Worker.submit_store` and `Manager.complete_store`.
        keys: Keys of the chunks to write, in prefix order.
        indices: int64 array (n,): position of each chunk in the caller's key list, so the
            caller picks the chunk's device block ids.
        slots: int64 array (n,): host slot of each chunk.
    """

    job_id: int
    keys: tuple[ChunkKey, ...]
    indices: np.ndarray
    slots: np.ndarray


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """Host-resident chunks held for reading (`Manager.prepare_load`).

    Attributes:
        job_id: Identifies the job in `Worker.submit_load` and `Manager.complete_load`.
        keys: Keys of the chunks to load: a prefix of the caller's key list.
        slots: int64 array (n,): host slot of each chunk.
        sources: Per chunk, the `tier` label of where it came from: "host", or the secondary
            tier whose promotion put it into host memory (its first load after the promotion).
    """

    job_id: int
    keys: tuple[ChunkKey, ...]
    slots: np.ndarray
    sources: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class TransferResult:
    """How a worker job ended (exactly once per submitted job).

    Attributes:
        job_id: As submitted.
        direction: D2H (store) or H2D (load).
        num_chunks: Chunks in the job.
        num_ok: Leading chunks whose bytes fully arrived; chunks at and after the first failure
            never count (a failed sub-transfer fails its chunk and the rest of the prefix).
        block_ids: int64 array (num_chunks, blocks_per_chunk): the job's device blocks, free for
            the engine to reuse now (stores) or holding loaded KV for the first num_ok chunks.
        error: First failure's reason, or None; "cancelled" for a cancelled job.
    """

    job_id: int
    direction: Direction
    num_chunks: int
    num_ok: int
    block_ids: np.ndarray
    error: str | None = None

    @property
    def ok(self) -> bool:
        """True if every chunk arrived."""
        return self.num_ok == self.num_chunks


@dataclass(frozen=True, slots=True)
class FinishedJob:
    """A job the engine ended, as `kvhal_job_finished` hook implementations see it: once per
    host job (`Manager.complete_store` / `complete_load`) and once per secondary-tier job
    (a cascade or a promotion, collected by `Manager.poll`).

    Attributes:
        tier: The `tier` label of where the chunks went or came from ("host" for a host job).
        kind: "store" or "load".
        job_id: The job's id (a host job's `StorePlan.job_id` / `LoadPlan.job_id`; a tier
            job's `TierJob.job_id`).
        keys: The job's chunk keys, in prefix order (a tier job: one).
        num_ok: Leading chunks that succeeded (the rest failed).
        seconds: From the job's start to its end (a host job: from `prepare_*`; a tier job: as
            its tier measured it).
        error: Why a tier job failed, or None (host jobs carry no reason).
    """

    tier: str
    kind: str
    job_id: int
    keys: tuple[ChunkKey, ...]
    num_ok: int
    seconds: float
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Every chunk of the job succeeded."""
        return self.num_ok == len(self.keys)
