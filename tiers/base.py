"""The secondary-tier contract, re-exported from its home in the core, `kvhal.tier`, for tiers
written against this module; new code imports `kvhal.tier`."""
from kvhal.tier import (HostAccess, HostSlots, JobKind, JobResult, Lookup, SecondaryTier,
                        TierError, TierJob, job_problem)

__all__ = ["HostAccess", "HostSlots", "JobKind", "JobResult", "Lookup", "SecondaryTier",
           "TierError", "TierJob", "job_problem"]
