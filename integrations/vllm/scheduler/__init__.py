"""The connector's scheduler side: maps vLLM requests to chunk keys and drives the manager.

Runs in vLLM's engine-core process. It never does I/O: it answers vLLM's "how many tokens can
you load" from `Manager.lookup`, reserves host slots for stores and loads, and ships the jobs
to the workers in `KVHalMetadata`. Workers answer in `KVHalWorkerMetadata`; a job completes in
the manager once every TP rank has finished it.

Read it in the order a request meets it (the split of vLLM's own offloading connector):
- `lookup`: the hit vLLM is told about, across every KV cache group, and the tier each hit
  token comes from (`HitLookup`).
- `loads`: the loads of a hit into the blocks vLLM allocated, synchronous or asynchronous, a
  late failure cut back, and the state-group fences (`LoadPlanner`).
- `stores`: the chunks due for storing, in order and without a gap (`StorePlanner`).
- `jobs`: the jobs in flight on the workers and what relates them, judged once every rank
  finished (`InFlightJobs`).
- `requests`: each live request's state and chunk keys (`RequestTable`); `counters`: the
  connector's counters and a request's load timeline.
- `side`: `SchedulerSide`, vLLM's hooks routed to those pieces, and the step's metadata.
"""
from .counters import PHASES, timeline
from .requests import MAX_OFFLOAD_TOKENS
from .side import IDLE_WAIT_MAX_S, IDLE_WAIT_S, REGION_NAME_PREFIX, IdleWait, SchedulerSide

__all__ = ["IDLE_WAIT_MAX_S", "IDLE_WAIT_S", "IdleWait", "MAX_OFFLOAD_TOKENS", "PHASES",
           "REGION_NAME_PREFIX", "SchedulerSide", "timeline"]
