"""The package's scenario runner plus the tests' fault injection (see the ops below).

Usage: python engine_run.py SCENARIO.json OUT.json (see `kvhal.integrations.harness.vllm.runner`).
Extra steps (TP=1 in-process engines):
    {"op": "noise", "seed": int}: overwrite this process's kvhal host region with seeded random
        bytes → number of bytes overwritten.
    {"op": "track_preemptions"}: record every request vLLM's scheduler preempts from now on
        → null.
    {"op": "preempted", "prompts": {name: [token ids]}}: names of the prompts preempted since
        `track_preemptions` → sorted list.
    {"op": "resumes", "prompts": {name: [token ids]}}: for each prompt preempted since
        `track_preemptions`, the tokens vLLM's own prefix cache held each time it was admitted
        again (its local hit, before the connector's) → {name: [tokens, ...]}.
    {"op": "poison_report"}: `poison.KVHalConnector`'s counters → {handed_out, reused,
        checked_chunks, poisoned_chunks}.
    {"op": "fault_loads", "tokens": [ids], "group": int, "chunk": int}: from now on every H2D
        copy reading the host slot of that chunk (KV cache group `group`, 1 block per chunk,
        sha256 block hashes seeded "0") faults on the device (`FaultyReadBackend`) → the slot.
        With "torn": true, such a copy also leaves zeros in its destination (a torn copy:
        wrong bytes in the device blocks vLLM reads before it learns of the failure).
    {"op": "heal_loads"}: no H2D copy faults any more (undoes every `fault_loads`) → null.
    {"op": "share_blocks", "group": int}: from now on, while kvhal places a load, every
        non-null block of that KV cache group holds one extra reference (as if vLLM shared it
        with another request) → null.
    {"op": "drop_chunk", "tokens": [ids], "group": int, "chunk": int}: discard that chunk from
        the host tier (that group can no longer serve it) → true if it was resident.
    {"op": "unlink", "paths": [...]}: delete files (an fs chunk vanishing after the tier
        indexed it) → number deleted.
    {"op": "drain"}: wait for every secondary-tier job (stores cascaded to fs land) → null.
    {"op": "clear_host"}: drop every chunk from kvhal's host tier (the next hit must come from
        a secondary tier) → null.
    {"op": "await_tier", "tokens": [ids], "tier": name, "timeout_s": s}: poll that secondary
        tier's lookup until every full chunk of `tokens` in every group is a HIT (files another
        process wrote, picked up by the tier's refresh) → seconds waited; TimeoutError after
        `timeout_s`.
"""
from __future__ import annotations

import ctypes
import os
import sys
import time

import numpy as np

from kvhal.backends.cpu import CpuBackend
from kvhal.integrations.harness.vllm import runner
from kvhal.integrations.vllm import worker
from kvhal.integrations.vllm.scheduler import REGION_NAME_PREFIX
from kvhal.keys import ChunkKey, block_hashes, hash_function, none_hash
from kvhal.tier import Lookup


def own_host_regions() -> list[str]:
    """`/proc/self/fd/N` paths of the kvhal host regions this process created."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(f"/memfd:{REGION_NAME_PREFIX}"):
            out.append(f"/proc/self/fd/{fd}")
    return out


def noise_host_region(llm, step: dict) -> int:
    """Fill every kvhal host region this process created with seeded random bytes."""
    total = 0
    for path in own_host_regions():
        region = np.memmap(path, dtype=np.uint8, mode="r+")
        region[:] = np.random.default_rng(step["seed"]).integers(0, 256, region.size,
                                                                 dtype=np.uint8)
        region.flush()
        total += region.size
    return total


def _scheduler(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


_PREEMPTED: list[tuple[int, ...]] = []
_RESUMED: dict[tuple[int, ...], list[int]] = {}


def track_preemptions(llm, step: dict) -> None:
    """Wrap the scheduler's `_preempt_request` to record the prompts it preempts, and its
    KV cache manager's `allocate_slots` to record each preempted request's local prefix hit
    (`num_new_computed_tokens`) when it is admitted again."""
    scheduler = _scheduler(llm)
    original = scheduler._preempt_request
    manager = scheduler.kv_cache_manager
    allocate = manager.allocate_slots

    def preempt(request, *args, **kwargs):
        _PREEMPTED.append(tuple(request.prompt_token_ids))
        return original(request, *args, **kwargs)

    def allocate_slots(request, *args, **kwargs):
        blocks = allocate(request, *args, **kwargs)
        if (blocks is not None and request.num_preemptions and request.num_computed_tokens == 0
                and "new_computed_blocks" in kwargs):     # a waiting request's admission
            _RESUMED.setdefault(tuple(request.prompt_token_ids), []).append(
                kwargs.get("num_new_computed_tokens", 0))
        return blocks

    scheduler._preempt_request = preempt
    manager.allocate_slots = allocate_slots


def preempted(llm, step: dict) -> list[str]:
    """Names of the prompts preempted since `track_preemptions`."""
    seen = set(_PREEMPTED)
    return sorted(name for name, ids in step["prompts"].items() if tuple(ids) in seen)


def resumes(llm, step: dict) -> dict[str, list[int]]:
    """See the module docstring."""
    return {name: _RESUMED[tuple(ids)] for name, ids in step["prompts"].items()
            if tuple(ids) in _RESUMED}


def poison_report(llm, step: dict) -> dict:
    """The poisoning connector's counters."""
    c = _scheduler(llm).get_kv_connector()
    return {"handed_out": c.handed_out, "reused": c.reused, "checked_chunks": c.checked_chunks,
            "poisoned_chunks": c.poisoned_chunks}


class FaultyReadBackend(CpuBackend):
    """A cpu backend on which every copy batch reading host bytes in `bad` ([start, end)
    address ranges) faults on the stream (surfacing at the job's event, like a device fault).
    Remembers its host registrations so a test can find the worker's view of the region."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.bad: list[tuple[int, int]] = []
        self.torn = False
        self.registered: list[tuple[int, int]] = []

    def register_host(self, ptr: int, nbytes: int):
        self.registered.append((ptr, nbytes))
        return super().register_host(ptr, nbytes)

    def _maybe_fault(self, srcs: np.ndarray, stream, spans: list[tuple[int, int]]) -> None:
        """Fault the stream if a copy reads a bad range; if `torn`, zero `spans` ((address,
        nbytes): the batch's destinations) first."""
        srcs = np.asarray(srcs, dtype=np.uint64)
        if any(((srcs >= lo) & (srcs < hi)).any() for lo, hi in self.bad):
            def fault():
                if self.torn:
                    for addr, nbytes in spans:
                        ctypes.memset(addr, 0, nbytes)
                raise OSError("injected device fault reading a host slot")
            self._worker(stream).submit(fault)

    def copy_2d_batch_async(self, copies, stream):
        super().copy_2d_batch_async(copies, stream)
        rows = np.asarray(copies, dtype=np.uint64)
        spans = [(int(dst) + h * int(pitch), int(width)) for dst, pitch, _, _, width, height
                 in rows.tolist() for h in range(int(height))] if self.torn else []
        self._maybe_fault(rows[:, 2], stream, spans)

    def copy_batch_async(self, dsts, srcs, sizes, stream):
        super().copy_batch_async(dsts, srcs, sizes, stream)
        spans = list(zip(np.asarray(dsts).tolist(), np.asarray(sizes).tolist()))
        self._maybe_fault(srcs, stream, spans if self.torn else [])


FAULTY: list[FaultyReadBackend] = []


def _select_backend(name):
    FAULTY.append(FaultyReadBackend())
    return FAULTY[-1]


def _side(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side


def _hashes(side, tokens: list[int]) -> list[bytes]:
    return block_hashes(tokens, side.deployment.block_size, hash_function("sha256"),
                        root=none_hash("sha256", "0"))


def _chunk_key(llm, step: dict):
    side = _side(llm)
    hashes = _hashes(side, step["tokens"])
    return side, ChunkKey(side.namespace, step["group"], hashes[step["chunk"]])


def drain(llm, step: dict) -> None:
    """See the module docstring."""
    _side(llm).manager.drain(timeout_s=120)


def clear_host(llm, step: dict) -> None:
    """See the module docstring."""
    _side(llm).manager.clear()


def await_tier(llm, step: dict) -> float:
    """See the module docstring."""
    side = _side(llm)
    (tier,) = [t for t in side.manager.tiers if t.name == step["tier"]]
    keys = [ChunkKey(side.namespace, g.group_id, h)
            for g in side.deployment.groups for h in _hashes(side, step["tokens"])]
    start = time.monotonic()
    while any(tier.lookup(k) is not Lookup.HIT for k in keys):
        if time.monotonic() - start > step["timeout_s"]:
            raise TimeoutError(f"{step['tier']}: chunks not visible after {step['timeout_s']} s")
        time.sleep(0.05)
    return time.monotonic() - start


def drop_chunk(llm, step: dict) -> bool:
    """See the module docstring."""
    side, key = _chunk_key(llm, step)
    found = key in side.manager.slots.index
    side.manager.discard([key])
    return found


def share_blocks(llm, step: dict) -> None:
    """See the module docstring."""
    side = _side(llm)
    original = side.update_state_after_alloc

    def update_state_after_alloc(request, blocks, num_external_tokens):
        held = [b for b in blocks.blocks[step["group"]] if not b.is_null]
        for b in held:
            b.ref_cnt += 1
        try:
            return original(request, blocks, num_external_tokens)
        finally:
            for b in held:
                b.ref_cnt -= 1

    side.update_state_after_alloc = update_state_after_alloc


def fault_loads(llm, step: dict) -> int:
    """See the module docstring."""
    side, key = _chunk_key(llm, step)
    slot = side.manager.slots.index[key]
    offset, nbytes = side.layout.slot_span(slot)
    # the workers' mapping of the region (the scheduler side's own mapping never copies)
    (base,) = [p for backend in FAULTY for p, n in backend.registered
               if n == side.layout.nbytes and p != side.region.ptr]
    for backend in FAULTY:
        backend.bad.append((base + offset, base + offset + nbytes))
        backend.torn = backend.torn or bool(step.get("torn"))
    return slot


def heal_loads(llm, step: dict) -> None:
    """See the module docstring."""
    for backend in FAULTY:
        backend.bad.clear()
        backend.torn = False


def unlink_files(llm, step: dict) -> int:
    """Delete `step["paths"]`."""
    for path in step["paths"]:
        os.unlink(path)
    return len(step["paths"])


if __name__ == "__main__":
    runner.OPS.update(noise=noise_host_region, track_preemptions=track_preemptions,
                      preempted=preempted, resumes=resumes, poison_report=poison_report,
                      fault_loads=fault_loads, heal_loads=heal_loads, drop_chunk=drop_chunk,
                      share_blocks=share_blocks, unlink=unlink_files, drain=drain, await_tier=await_tier,
                      clear_host=clear_host)
    worker.plugins.select_backend = _select_backend
    runner.main(sys.argv[1:])
