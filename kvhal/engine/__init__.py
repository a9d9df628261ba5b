"""The tiering engine (DESIGN §5): the manager decides, the worker moves bytes.

How an integration drives the engine
====================================

Setup (once)::

    cfg = kvhal.config.parse_config(extra_config)              # ConfigError names the key path
    tpc = block_size * cfg.blocks_per_chunk_for(block_size)   # tokens per chunk
    ns = kvhal.keys.namespace_digest(weights=..., kv_dtype=..., format_id=...,
                                     tokens_per_chunk=tpc, hash_name="sha256",
                                     hash_seed=os.environ["PYTHONHASHSEED"])
    geo = kvhal.host.host_geometry(chunk_nbytes, cfg.cpu_bytes_to_use,
                                   kvhal.config.host_tail_bytes(cfg))  # tiers' slot tails
    region = HostRegion.allocate(backend, geo)                  # or create_shared/attach_shared
    manager = build_manager(cfg, geo, region.view, ns)          # scheduler side
    worker = Worker(backend, planner, host_ptr=region.ptr, slot_bytes=geo.slot_bytes)

`planner(block_ids, slot_addr, direction) -> CopyPlan` maps one chunk (its device block ids)
to HAL copies: `LayoutPlanner(kvhal.layout.chunk_mapper(spec, layout, tp_size, tp_rank, bpc),
kvhal.layout.device_cache(mapper, layer_tensors))` for model layouts (chunk_nbytes is then
`mapper.chunk.chunk_bytes`), `BlockPlanner` for a single contiguous block buffer; a planner with
`plan_job` (`JobPlanner`) plans a whole job in one vectorised call. With TP > 1 every
rank's worker moves its share into the same shared slot (`HostRegion.create_shared` /
`attach_shared`); complete a job with the smallest `num_ok` over the ranks. Keys: `kvhal.keys.chunk_keys(block_hashes, blocks_per_chunk, ns)` over vLLM's own
block hashes (or `kvhal.keys.block_hashes(...)`, which computes them the same way).

Each scheduler step, per waiting request (scheduler side, never blocks)::

    answers = manager.lookup(keys, pin_owner=rid)   # HIT/MISS/RETRY/UNDECIDED; pins HITs
    n = leading_hits(answers)                        # None: on its way or undecided: ask again
    # after the engine allocated device blocks for n chunks:
    plan = manager.prepare_load(keys[:n], pin_owner=rid)   # None if nothing; drops the pins
    -> send (plan.job_id, plan.slots, device block ids of the plan's chunks) to the worker
    # request finished/aborted/preempted without loading:
    manager.release(rid)

Each step, per running request with newly computed tokens::

    due = chunks_to_store(num_computed_tokens, num_stored_chunks, tpc, max_offload_tokens)
    plan = manager.prepare_store([keys[i] for i in due])       # None: nothing to do
    -> send (plan.job_id, plan.slots, device block ids of due[plan.indices]) to the worker

Worker side, each step::

    worker.submit_load(job_id, block_ids, slots)               # before the forward pass
    event = record an event on the compute stream after the forward pass
    worker.submit_store(job_id, block_ids, slots, after=event) # waits for the compute
    for r in worker.get_finished():                            # TransferResult, once per job
        -> send (r.job_id, r.direction, r.num_ok) to the scheduler side; for a store the
           device blocks r.block_ids are free again; for a load the first r.num_ok chunks hold
           KV, the rest must be recomputed
    before a preempted request's blocks are reused: worker.wait_blocks(its block ids)
    (or worker.cancel(job_id): the job then ends failed, still after its copies finish)

Scheduler side, when results arrive::

    manager.complete_store(job_id, num_ok)   # first num_ok chunks become HITs and cascade
    manager.complete_load(job_id, num_ok)    # releases the slots
    manager.poll()                           # collect secondary-tier jobs (lookup also does)
    manager.take_events()                    # BlockStored/BlockRemoved/AllBlocksCleared

Every job ends exactly once: each `prepare_*` plan must be completed exactly once, with the
worker's `num_ok` (0 for a job that never ran). Shutdown: `worker.close()`, `manager.close()`
(drains and closes the tiers), then `region.close()`.
"""
from .build import build_manager
from .manager import Manager
from .planner import BlockPlanner, LayoutPlanner
from .requests import PrefixHit, chunks_to_store, leading_hits, needed_chunks, prefix_hit
from .types import (Direction, EngineError, FinishedJob, LoadPlan, StorePlan,
                    TransferResult)
from .worker import JobPlanner, Planner, Worker

__all__ = ["BlockPlanner", "Direction", "EngineError", "FinishedJob", "LayoutPlanner",
           "LoadPlan", "Manager", "PrefixHit",
           "JobPlanner", "Planner",
           "StorePlan", "TransferResult", "Worker", "build_manager", "chunks_to_store",
           "leading_hits", "needed_chunks", "prefix_hit"]
