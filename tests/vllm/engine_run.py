"""The package's scenario runner plus the tests' fault injection (`noise`).

Usage: python engine_run.py SCENARIO.json OUT.json (see `kvhal.integrations.vllm.runner`).
Extra steps (TP=1 in-process engines):
    {"op": "noise", "seed": int}: overwrite this process's kvhal host region with seeded random
        bytes → number of bytes overwritten.
    {"op": "track_preemptions"}: record every request vLLM's scheduler preempts from now on
        → null.
    {"op": "preempted", "prompts": {name: [token ids]}}: names of the prompts preempted since
        `track_preemptions` → sorted list.
    {"op": "poison_report"}: `poison.KVHalConnector`'s counters → {handed_out, reused,
        checked_chunks, poisoned_chunks}.
"""
from __future__ import annotations

import os
import sys

import numpy as np

from kvhal.integrations.vllm import runner
from kvhal.integrations.vllm.scheduler import REGION_NAME_PREFIX


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


def track_preemptions(llm, step: dict) -> None:
    """Wrap the scheduler's `_preempt_request` to record the prompts it preempts."""
    scheduler = _scheduler(llm)
    original = scheduler._preempt_request

    def preempt(request, *args, **kwargs):
        _PREEMPTED.append(tuple(request.prompt_token_ids))
        return original(request, *args, **kwargs)

    scheduler._preempt_request = preempt


def preempted(llm, step: dict) -> list[str]:
    """Names of the prompts preempted since `track_preemptions`."""
    seen = set(_PREEMPTED)
    return sorted(name for name, ids in step["prompts"].items() if tuple(ids) in seen)


def poison_report(llm, step: dict) -> dict:
    """The poisoning connector's counters."""
    c = _scheduler(llm).get_kv_connector()
    return {"handed_out": c.handed_out, "reused": c.reused, "checked_chunks": c.checked_chunks,
            "poisoned_chunks": c.poisoned_chunks}


if __name__ == "__main__":
    runner.OPS.update(noise=noise_host_region, track_preemptions=track_preemptions,
                      preempted=preempted, poison_report=poison_report)
    runner.main(sys.argv[1:])
