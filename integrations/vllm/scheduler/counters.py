"""What the scheduler side counts: chunks loaded, stored, failed and skipped, in total and per
KV cache group, and each request's load timeline (`timeline`)."""
from __future__ import annotations

from typing import Any

from kvhal.engine import Manager
from kvhal.host import HostLayout

from ..geometry import Deployment

#: Load phases reported by `timeline`, in order.
PHASES = ("lookup", "alloc", "first_h2d_issue", "landed", "h2d_issue", "recv_done")


def timeline(times: dict[str, float], request: Any) -> dict[str, float]:
    """A request's load phases in ms after its arrival (vLLM's `Request.arrival_time`,
    time.time() seconds): lookup (first `get_num_new_matched_tokens`), alloc (vLLM allocated
    its blocks), first_h2d_issue (asynchronous loads: first landed chunks shipped to the
    device), landed (asynchronous loads: every chunk in host memory, or the first failure
    found), h2d_issue (last host → device copy issued), recv_done (asynchronous loads: every
    worker finished). Phases that did not happen are absent."""
    arrival = getattr(request, "arrival_time", None)
    if arrival is None:
        return {}
    return {p: round((times[p] - arrival) * 1e3, 3) for p in PHASES if p in times}


class SideCounters:
    """The connector's own counters, reported by `SchedulerSide.stats` beside the manager's.

    Args:
        num_groups: KV cache groups of the deployment.

    Attributes:
        totals: name → count. load_chunks, load_failed_chunks, store_chunks,
            store_failed_chunks; store_skipped_chunks: due for storing, never placed (no free
            host slot before the request ended, `StorePlanner.skip`); load_late_failures:
            asynchronous loads cut back after a chunk failed (`loads` module docstring);
            state_block_fences: steps whose forward waited for state stores reading a block
            vLLM gave to new use.
        by_group: name → [count of group 0, group 1, ...] for the chunk counters.
    """

    def __init__(self, num_groups: int):
        self.totals = {"load_chunks": 0, "load_failed_chunks": 0, "store_chunks": 0,
                       "store_failed_chunks": 0, "store_skipped_chunks": 0}
        self.by_group = {k: [0] * num_groups for k in self.totals}
        self.totals["load_late_failures"] = 0
        self.totals["state_block_fences"] = 0

    def add(self, name: str, group: int, num_chunks: int) -> None:
        """Count `num_chunks` chunks of `group` under `name`, in total and for the group."""
        self.totals[name] += num_chunks
        self.by_group[name][group] += num_chunks

    def stats(self, manager: Manager, deployment: Deployment, layout: HostLayout
              ) -> dict[str, Any]:
        """These counters plus the manager's and every tier's, and per KV cache group
        (`groups`, in group order): kind, canonical chunk bytes, host slot bytes, slots, host
        bytes (slots × slot bytes, exact), resident chunks, and the load/store counters."""
        index = manager.slots.index
        groups = []
        for g, pool in zip(deployment.groups, layout.pools):
            resident = sum(1 for k in index if k.group == g.group_id)
            groups.append({"group": g.group_id, "kind": g.kind.value,
                           "chunk_bytes": pool.chunk_nbytes, "slot_bytes": pool.slot_bytes,
                           "slots": pool.capacity, "host_bytes": pool.nbytes,
                           "resident": resident,
                           **{k: v[g.group_id] for k, v in self.by_group.items()}})
        return {**self.totals, **manager.stats(), "groups": groups,
                "tiers": {t.name: dict(t.stats()) for t in manager.tiers}}
