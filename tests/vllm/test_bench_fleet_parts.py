"""`kvhal bench fleet`'s parts that need no server: the router flag, the router-stats delta,
the targets' ratios, an instance's SPEC and kvhal config, the hot-prefix workload."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from kvhal.integrations.harness.bench.fleet import (
    Instance,
    flatten_numbers,
    numeric_delta,
    parse_routers,
    ratios,
    stats_line,
    targets,
)
from kvhal.integrations.harness.vllm.chat import ChatShape, shared_prefix, user_tokens


def test_routers_are_kept_in_their_order_and_unknown_ones_named():
    assert parse_routers("kv-p2p, round-robin") == ["round-robin", "kv-p2p"]
    with pytest.raises(argparse.ArgumentTypeError, match="unknown router.*'random'"):
        parse_routers("kv,random")


def test_router_stats_delta_subtracts_numbers_at_every_depth():
    """Fails when a nested counter is taken as it is after the point (7, not 4), or a key
    new after the point is dropped; seen with lists (the per-instance counts of a stats
    answer) taken as they are."""
    before = {"instances": {"a": {"routed": 3, "reason": {"kv": 1}}}, "policy": "kv"}
    after = {"instances": {"a": {"routed": 7, "reason": {"kv": 2, "load": 1}}},
             "policy": "kv", "up": True}
    assert numeric_delta(before, after) == {
        "instances": {"a": {"routed": 4, "reason": {"kv": 1, "load": 1}}}, "policy": "kv",
        "up": True}
    assert numeric_delta({"i": [{"routed": 2}]}, {"i": [{"routed": 5}, {"routed": 1}]}) == {
        "i": [{"routed": 3}, {"routed": 1}]}
    assert flatten_numbers({"i": [{"routed": 4}, {"routed": 0}], "up": True, "p": "kv"}) == {
        "i.0.routed": 4, "i.1.routed": 0}


def test_the_stats_line_names_each_instances_reasons_and_predicted_hits():
    stats = {"route": "kv", "instances": [
        {"routed": 5, "by_reason": {"kv": 4, "load": 1, "p2p": 0},
         "predicted_hit_tokens": {"device": 512, "host": 0}, "load": 3},
        {"routed": 0, "by_reason": {"kv": 0}, "predicted_hit_tokens": {"device": 0}}]}
    assert stats_line(stats) == ("instance 0: routed 5 (kv 4 load 1), predicted hits "
                                 "(device 512); instance 1: routed 0 (), predicted hits (none)")
    assert stats_line({"error": "URLError: refused"}) == "(nothing counted)"
    assert stats_line({"requests": 3}) == "requests 3"


def _point(rps, p90):
    return {"requests_per_s": rps, "ttft_s": {"p50": None, "p90": p90}}


def test_targets_compare_the_right_routers_at_the_right_points():
    """Fails when a ratio is taken upside down or at the other point (multi-turn is first,
    hot-prefix second)."""
    points = {"round-robin": [_point(1.0, 3.0), _point(9.0, 9.0)],
              "kv": [_point(2.0, 0.6), _point(9.0, 2.0)],
              "kv-p2p": [_point(9.0, 9.0), _point(9.0, 1.0)]}
    measured = ratios(points)
    assert measured == {"kv_over_round_robin_requests_per_s": 2.0,
                        "kv_over_round_robin_ttft_p90": pytest.approx(0.2),
                        "kv_p2p_over_kv_ttft_p90": 0.5}
    assert [t["met"] for t in targets(measured)] == [True, True, True]
    slow = ratios({"round-robin": points["round-robin"], "kv": [_point(1.2, 2.0), _point(1, 1)]})
    assert slow["kv_p2p_over_kv_ttft_p90"] is None
    assert [t["met"] for t in targets(slow)] == [False, False, None]


def test_an_instance_is_named_to_the_router_as_the_contract_says(tmp_path):
    inst = Instance(8001, 5557, 5558, 7001, tmp_path / "fs-0", 1)
    assert inst.spec() == ("http://127.0.0.1:8001,events=tcp://127.0.0.1:5557,"
                           "replay=tcp://127.0.0.1:5558,p2p=127.0.0.1:7001")
    config = inst.kv_transfer_config(32 << 20, 64 << 20, Path("/k/p2p.key"))
    extra = config["kv_connector_extra_config"]
    assert extra["blocks_per_chunk"] == 1         # the reference's reuse boundary: one block
    assert [t["type"] for t in extra["secondary_tiers"]] == ["fs", "p2p"]
    assert "peers" not in extra["secondary_tiers"][1]      # pulls only what a request names
    assert extra["secondary_tiers"][1]["port"] == 7001
    # vLLM's publisher binds only a wildcard endpoint (it connects to 127.0.0.1:5557, and
    # the router, which connects too, never hears it: seen, no event in 15 s)
    assert inst.kv_events_config()["endpoint"] == "tcp://*:5557"
    assert inst.kv_events_config()["replay_endpoint"] == "tcp://*:5558"


def test_every_hot_prefix_session_starts_with_the_same_system_prompt():
    """Fails when the shared prefix is seeded by the conversation (sessions would share
    nothing) or left out of the longest prompt."""
    shape = ChatShape(16, 2, 128, 128, 16, 8, seed=3, shared_prefix_tokens=2048)
    assert shape.longest_prompt() == 2048 + 128 + 16 + 128
    prefix = shared_prefix(shape, 4096)
    assert len(prefix) == 2048 and prefix == shared_prefix(shape, 4096)
    assert prefix != shared_prefix(ChatShape(16, 2, 128, 128, 16, 8, seed=4,
                                             shared_prefix_tokens=2048), 4096)
    assert user_tokens(shape, "c0", 0, 4096) != user_tokens(shape, "c1", 0, 4096)
    assert shared_prefix(ChatShape(1, 1, 8, 8, 1, 1), 4096) == []
