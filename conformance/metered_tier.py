"""`metered`: a tier written outside kvhal that declares metrics of its own (the example of
README "Writing a secondary tier" and the tier the conformance suite's metrics check serves
through a real vLLM server). It is the in-process `memory` tier plus three figures: store jobs
by outcome (counter), their wall time (histogram, seconds), chunks held (gauge).

Config: as `memory`, loaded by `{"type": "metered", "module_path":
"conformance.metered_tier:MeteredTier"}`.
"""
from __future__ import annotations

from kvhal.tier import JobKind, JobResult
from kvhal.tier_metrics import MetricSpec
from kvhal.tiers.memory import MemoryTier


class MeteredTier(MemoryTier):
    """The memory tier with metrics of its own (see the module docstring)."""

    name = "metered"
    metric_specs = (
        MetricSpec("stores", "counter", "Store jobs by outcome",
                   labels={"outcome": ("ok", "error")}),
        MetricSpec("store_seconds", "histogram", "Wall time of one store job, seconds",
                   buckets=(0.001, 0.01, 0.1, 1.0)),
        MetricSpec("held_chunks", "gauge", "Chunks the tier holds now"),
    )

    def get_finished_jobs(self) -> list[JobResult]:
        """The memory tier's results, counted on the way out."""
        done = super().get_finished_jobs()
        for result in done:
            if result.kind is JobKind.STORE:
                self.metrics["stores"].labels(outcome="ok" if result.ok else "error").inc()
                self.metrics["store_seconds"].observe(result.seconds)
        self.metrics["held_chunks"].set(len(self._data))
        return done
