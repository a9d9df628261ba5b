"""The package's scenario runner plus the tests' fault injection (`noise`).

Usage: python engine_run.py SCENARIO.json OUT.json (see `kvhal.integrations.vllm.runner`).
Extra step: {"op": "noise", "seed": int}: overwrite this process's kvhal host region (TP=1
in-process engines) with seeded random bytes → number of bytes overwritten.
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


if __name__ == "__main__":
    runner.OPS["noise"] = noise_host_region
    runner.main(sys.argv[1:])
