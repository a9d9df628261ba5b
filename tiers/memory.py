"""`memory`: a small in-process example tier (a dict of bytes with LRU capacity).

It shows the `SecondaryTier` contract at its simplest and is the second tier the tier
conformance suite runs against. Jobs complete synchronously inside `submit_*`.

Config: `{"type": "memory", "max_bytes": int}` (default 1 GiB).
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Any, Mapping

from kvhal.keys import ChunkKey

from kvhal.tier import JobResult, Lookup, SecondaryTier, TierError, TierJob, job_problem

DEFAULT_MAX_BYTES = 1 << 30
#: Keys of a `secondary_tiers` entry this tier accepts ("type"/"module_path" are the loader's).
_KEYS = ("max_bytes", "module_path", "type")


class MemoryTier(SecondaryTier):
    """In-memory LRU tier (see module docstring).

    Raises:
        TierError: an unknown config key or a `max_bytes` that is not a positive integer.
    """

    name = "memory"
    medium = "CPU"
    hit_source = "host"

    def __init__(self, config: Mapping[str, Any], host: memoryview, namespace: bytes):
        unknown = sorted(str(k) for k in config if k not in _KEYS)
        if unknown:
            raise TierError(f"{unknown[0]}: unknown key for the memory tier; accepted: max_bytes")
        max_bytes = config.get("max_bytes", DEFAULT_MAX_BYTES)
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes <= 0:
            raise TierError(f"max_bytes: must be a positive integer, got {max_bytes!r}")
        self._host = host
        self._namespace = namespace
        self.max_bytes = max_bytes
        self._data: collections.OrderedDict[ChunkKey, bytes] = collections.OrderedDict()
        self._used = 0
        self._finished: list[JobResult] = []
        self._lock = threading.Lock()
        self._stats = collections.Counter()
        self._removed: list[ChunkKey] = []

    def lookup(self, key: ChunkKey) -> Lookup:
        """HIT if held."""
        with self._lock:
            return Lookup.HIT if key in self._data else Lookup.MISS

    def submit_store(self, job: TierJob) -> None:
        """Copy the slot's bytes in; evict least recently used chunks to fit."""
        t0 = time.perf_counter()
        with self._lock:
            if (problem := job_problem(job, len(self._host), self._namespace)) is not None:
                return self._finish(job, t0, problem)
            if job.nbytes > self.max_bytes:
                return self._finish(job, t0, "chunk larger than max_bytes")
            if job.key in self._data:
                self._data.move_to_end(job.key)
                return self._finish(job, t0)
            while self._used + job.nbytes > self.max_bytes:
                gone, old = self._data.popitem(last=False)
                self._used -= len(old)
                self._removed.append(gone)
                self._stats["evictions"] += 1
            self._data[job.key] = bytes(self._host[job.offset:job.offset + job.nbytes])
            self._used += job.nbytes
            self._stats["bytes_stored"] += job.nbytes
            self._finish(job, t0)

    def submit_load(self, job: TierJob) -> None:
        """Copy the chunk into the slot, or fail if absent or of another size."""
        t0 = time.perf_counter()
        with self._lock:
            if (problem := job_problem(job, len(self._host), self._namespace)) is not None:
                return self._finish(job, t0, problem)
            data = self._data.get(job.key)
            if data is None:
                return self._finish(job, t0, "not found")
            if len(data) != job.nbytes:
                return self._finish(job, t0, f"size {len(data)} != requested {job.nbytes}")
            self._data.move_to_end(job.key)
            self._host[job.offset:job.offset + job.nbytes] = data
            self._stats["bytes_loaded"] += job.nbytes
            self._finish(job, t0)

    def _finish(self, job: TierJob, t0: float, error: str | None = None) -> None:
        self._finished.append(JobResult(job.job_id, job.kind, job.key, error is None, error,
                                        time.perf_counter() - t0))
        if error:
            self._stats[f"{job.kind.value}_failed"] += 1

    def get_finished_jobs(self) -> list[JobResult]:
        """Results since the last call."""
        with self._lock:
            out, self._finished = self._finished, []
            return out

    def take_removed(self) -> list[ChunkKey]:
        """Keys evicted since the last call."""
        with self._lock:
            out, self._removed = self._removed, []
            return out

    def drain(self, timeout_s: float | None = None) -> None:
        """Nothing is ever pending."""

    def close(self) -> None:
        """Drop every chunk."""
        with self._lock:
            self._data.clear()
            self._used = 0

    def stats(self) -> Mapping[str, Any]:
        """bytes_stored, bytes_loaded, evictions, used_bytes, max_bytes, chunks."""
        with self._lock:
            return dict(self._stats, used_bytes=self._used, max_bytes=self.max_bytes,
                        chunks=len(self._data))

