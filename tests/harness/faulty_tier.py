"""`FaultyMemoryTier`: a memory tier that flips one byte of every chunk it loads and still
reports the load as ok — a fault no real tier produces on demand, used to show that the
replay's byte-for-byte verification fails the run."""
from __future__ import annotations

from kvhal.tiers.memory import MemoryTier


class FaultyMemoryTier(MemoryTier):
    """See module docstring. Config: as `memory` (`{"type": "faulty", "module_path": ...}`)."""

    name = "faulty"

    def submit_load(self, job):
        """Load, then corrupt the last byte of the slot."""
        super().submit_load(job)
        self._host[job.offset + job.nbytes - 1] ^= 0xFF
