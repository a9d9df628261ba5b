"""`kvhal proxy --route ...` (fleet mode) as its own process in front of recording backends
(real HTTP servers, `servers.py`), fed KV events by vLLM's own `ZmqEventPublisher`.
What real vLLM instances do behind it: tests/vllm/test_fleet_e2e.py."""
from __future__ import annotations

import http.client
import json
import subprocess
import time
import urllib.request

import pytest

pytest.importorskip("aiohttp", reason="kvhal proxy needs the `proxy` extra")
kv_events = pytest.importorskip("vllm.distributed.kv_events",
                                reason="vLLM's publisher produces the test events")

from kvhal.procs import free_port

from .servers import (
    KVHAL,
    BackendProcess,
    FaultyBackend,
    ProxyProcess,
    SSEStream,
    request,
)

B = 16
TOKENS = list(range(2000, 2000 + 8 * B))
BODY = {"model": "m", "prompt": TOKENS, "max_tokens": 4}


@pytest.fixture
def backend_process(backend):
    """Factory of echo backends in their own processes (`freeze()` = SIGSTOP), killed at
    teardown."""
    return lambda name: backend(name, cls=BackendProcess)


@pytest.fixture
def fleet(proxy_process):
    """Factory: `fleet(policy, specs, *args)` starts `kvhal proxy --route policy` over the
    `--instance` specs."""
    def start(policy: str, specs: list[str], *args: str) -> ProxyProcess:
        argv = [a for s in specs for a in ("--instance", s)]
        return proxy_process("fleet", "--route", policy, "--health-interval-s", "0.5",
                             *argv, *args)
    return start


def stats(px: ProxyProcess) -> dict:
    status, out = request(f"{px.url}/router/stats")
    assert status == 200, out
    return out


def wait(condition, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not (out := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return out


class Publisher:
    """vLLM's `ZmqEventPublisher` (PUB + replay) on free ports, as an instance's
    `--kv-events-config` starts it."""

    def __init__(self):
        port, rport = free_port(), free_port()
        self.pub = kv_events.ZmqEventPublisher(0, endpoint=f"tcp://*:{port}",
                                               replay_endpoint=f"tcp://*:{rport}")
        self.spec = f"events=tcp://127.0.0.1:{port},replay=tcp://127.0.0.1:{rport}"

    def blocks(self, tokens: list[int], medium: str = "GPU") -> None:
        n = len(tokens) // B
        self.pub.publish(kv_events.KVEventBatch(ts=time.time(), events=[
            kv_events.BlockStored(block_hashes=[f"b{i}".encode() for i in range(n)],
                                  parent_block_hash=None, token_ids=tokens[:n * B],
                                  block_size=B, lora_id=None, medium=medium,
                                  lora_name=None)]))


@pytest.fixture
def publisher():
    made = []

    def make() -> Publisher:
        made.append(Publisher())
        return made[-1]
    yield make
    for p in made:
        p.pub.shutdown()


def test_kv_routes_to_the_holder_and_kv_p2p_pulls_from_it_when_busy(backend, fleet,
                                                                     publisher):
    """Instance b announced the prompt (device and host). kv sends it there; once b has 2
    requests in flight, kv-p2p sends the next to a with `remote_kv_source` naming b's p2p
    tier. Fails when the router ignores the events (the first request goes to a, in turn)
    or kv-p2p never pulls (the third request goes to b or without remote_kv_source)."""
    a, b = backend("a"), backend("b")
    pub = publisher()
    pub.blocks(TOKENS)
    pub.blocks(TOKENS, medium="CPU")
    px = fleet("kv-p2p", [a.url, f"{b.url},{pub.spec},p2p=127.0.0.1:7777"],
               "--load-tokens", "40",     # 1 in flight < 128 held tokens; 2 > 128 / 2
               "--p2p-min-tokens", "64")
    wait(lambda: stats(px)["instances"][1]["index_blocks"]["host"] == 8,
         "b's events in the index")
    status, out = request(f"{px.url}/v1/completions", BODY)
    assert (status, out["backend"]) == (200, "b")
    assert "kv_transfer_params" not in out["echo"]
    held = [SSEStream(f"{px.url}/v1/completions", BODY | {"stream": True}) for _ in range(2)]
    try:
        wait(lambda: len(b.legs) == 3, "two streams held on b")
        status, out = request(f"{px.url}/v1/completions", BODY)
        assert (status, out["backend"]) == (200, "a")
        source = out["echo"]["kv_transfer_params"]["remote_kv_source"]
        assert (source["remote_host"], source["remote_port"]) == ("127.0.0.1", 7777)
    finally:
        for s in held:
            s.close()
    s = stats(px)
    assert s["route"] == "kv-p2p" and s["requests"] == 4
    sa, sb = s["instances"]
    assert sb["by_reason"]["kv"] == 3 and sa["by_reason"]["p2p"] == 1
    assert sa["predicted_hit_tokens"]["p2p"] == 8 * B
    assert sb["predicted_hit_tokens"]["device"] == 3 * 8 * B
    assert sb["events"]["state"] == "live" and sb["events"]["replays"] >= 1
    wait(lambda: [i["in_flight"] for i in stats(px)["instances"]] == [0, 0],
         "the streams the client closed to end", 10)


def test_a_body_is_sent_on_as_the_client_s_bytes_unless_remote_kv_source_is_added(
        backend, fleet):
    """The router forwards the client's JSON bytes as they came (no decode-encode round
    trip for a 50 MB prompt; key order, spacing and number spelling kept). Fails when the
    body is re-encoded."""
    a = backend("a")
    px = fleet("kv", [a.url])
    raw = b'{ "prompt" : [5, 6, 7],\n  "model": "m", "max_tokens": 2, "x": 1.50 }'
    req = urllib.request.Request(f"{px.url}/v1/completions", data=raw,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert json.loads(resp.read())["backend"] == "a"
    assert a.legs[-1].raw == raw
    assert a.legs[-1].headers["Content-Type"] == "application/json"


def test_an_instance_answering_5xx_or_dead_is_routed_around(backend, fleet):
    """Fails when a 5xx or an unreachable instance fails the client's request (no retry) or
    keeps getting requests."""
    bad, good = backend("bad", FaultyBackend, status=503), backend("good")
    dead = backend("dead")
    dead.stop()
    px = fleet("round-robin", [bad.url, dead.url, good.url])
    for _ in range(4):
        status, out = request(f"{px.url}/v1/completions", BODY)
        assert (status, out["backend"]) == (200, "good")
    s = stats(px)
    assert [i["healthy"] for i in s["instances"]] == [False, False, True]
    assert len(bad.legs) <= 1
    log = px.log.read_text()
    assert "answered HTTP 503): routed around, its index dropped" in log
    assert f"instance {dead.url} is unhealthy (ClientConnectorError" in log


def test_a_frozen_instance_s_request_is_re_sent_after_the_first_byte_timeout(
        backend_process, fleet):
    """Instance a is SIGSTOPped after the router saw it healthy (health polls too rare to
    notice): the request sent to it is answered by b once the first-byte timeout passed, and
    a is marked unhealthy. Fails when the router waits on a frozen instance (the request
    hangs past the client's 30 s) or does not mark it down (the next request goes to a)."""
    a, b = backend_process("a"), backend_process("b")
    px = fleet("round-robin", [a.url, b.url], "--first-byte-timeout-s", "2",
               "--health-interval-s", "600")
    a.freeze()
    t0 = time.monotonic()
    status, out = request(f"{px.url}/v1/completions", BODY, timeout_s=30)
    assert (status, out["backend"]) == (200, "b")
    assert 2 <= time.monotonic() - t0 < 30
    sa, sb = stats(px)["instances"]
    assert (sa["healthy"], sa["in_flight"], sa["routed"], sb["routed"]) == (False, 0, 1, 1)
    assert sa["last_error"] == "no byte of its answer within 2 s (--first-byte-timeout-s)"
    status, out = request(f"{px.url}/v1/completions", BODY | {"stream": True}, timeout_s=30)
    assert status == 200 and '"backend": "b"' in out
    assert f"request re-sent from {a.url} (no byte of its answer" in px.log.read_text()


def test_a_request_is_re_sent_once_then_504(backend_process, fleet):
    """a and b frozen, c fine: the request tries a, is re-sent to b, and then ends with a 504
    naming b; c never sees it. Fails when a slow request is re-sent more than once (c
    answers) or hangs."""
    a, b, c = (backend_process(n) for n in "abc")
    px = fleet("round-robin", [a.url, b.url, c.url], "--first-byte-timeout-s", "1",
               "--health-interval-s", "600")
    a.freeze()
    b.freeze()
    status, out = request(f"{px.url}/v1/completions", BODY, timeout_s=30)
    assert status == 504, out
    assert out["error"]["message"] == (f"instance {b.url} sent no byte of its answer within "
                                       f"1 s (--first-byte-timeout-s)")
    assert [i["routed"] for i in stats(px)["instances"]] == [1, 1, 0]


def test_health_polls_catch_a_frozen_instance_within_seconds_and_it_recovers(
        backend_process, fleet):
    """SIGSTOP: `/health` polls (every 0.5 s, each timing out after 1 s) mark it unhealthy
    within a few seconds, SIGCONT brings it back. Fails when a poll has no timeout (it
    waits forever on the frozen instance, which stays healthy)."""
    a, b = backend_process("a"), backend_process("b")
    px = fleet("round-robin", [a.url, b.url])
    a.freeze()
    t0 = time.monotonic()
    state = px.wait_health(lambda s: s["instances"][0]["healthy"] is False, timeout_s=10)
    assert time.monotonic() - t0 < 5
    assert state["instances"][0]["last_error"] == "timed out"
    a.thaw()
    px.wait_health(lambda s: s["instances"][0]["healthy"] is True, timeout_s=10)
    got = {request(f"{px.url}/v1/completions", BODY)[1]["backend"] for _ in range(2)}
    assert got == {"a", "b"}


def test_an_answer_frozen_after_its_first_bytes_ends_incomplete_and_is_not_re_sent(
        backend_process, fleet):
    """a streams an event every 50 ms; once the client has one, a is SIGSTOPped. The client's
    body ends incomplete within the first-byte timeout (used between chunks), and b never
    gets the request. Fails when the router waits forever between chunks (the client's read
    times out) or re-sends a request whose bytes reached the client."""
    a, b = backend_process("a"), backend_process("b")
    px = fleet("round-robin", [a.url, b.url], "--first-byte-timeout-s", "2",
               "--health-interval-s", "600")
    stream = SSEStream(f"{px.url}/v1/completions",
                       BODY | {"stream": True, "events": 10_000, "interval_s": 0.05},
                       timeout_s=15)
    try:
        assert json.loads(stream.next_event())["backend"] == "a"
        a.freeze()
        with pytest.raises(http.client.IncompleteRead):
            while True:
                assert stream.next_event() != "[DONE]"
    finally:
        stream.close()
    sa, sb = stats(px)["instances"]
    assert (sa["healthy"], sa["routed"], sb["routed"]) == (False, 1, 0)
    assert sa["last_error"] == "failed mid-answer: no byte for 2 s"


def test_a_silent_event_stream_clears_the_index(backend, fleet, publisher):
    """b announced the prompt, then its publisher goes quiet while the router sends it
    requests that must store blocks: after --events-silence-s its index is cleared and its
    events state is "silent". Fails when the proxy never checks for silence."""
    a, b = backend("a"), backend("b")
    pub = publisher()
    pub.blocks(TOKENS)
    px = fleet("kv", [a.url, f"{b.url},{pub.spec}"], "--events-silence-s", "1")
    wait(lambda: stats(px)["instances"][1]["index_blocks"]["device"] == 8,
         "b's events in the index")
    longer = BODY | {"prompt": TOKENS + list(range(9000, 9000 + 2 * B))}
    assert request(f"{px.url}/v1/completions", longer)[1]["backend"] == "b"
    s = wait(lambda: (s := stats(px)["instances"][1])["events"]["state"] == "silent" and s,
             "b's stream found silent", 15)
    assert (s["events"]["silences"], s["index_blocks"]["device"], s["healthy"]) == (1, 0, True)
    assert "no event batch for 1 s after requests that store blocks" in px.log.read_text()


def test_the_last_instance_s_5xx_is_passed_through_and_503_when_none_is_healthy(
        backend, fleet):
    """Fails when a failing fleet hangs the request or answers something else."""
    bad = backend("bad", FaultyBackend, status=500)
    px = fleet("kv", [bad.url])
    status, out = request(f"{px.url}/v1/completions", BODY)
    assert status == 500 and "refuses" in json.dumps(out)
    bad.health_status = 503
    wait(lambda: request(f"{px.url}/v1/completions", BODY)[0] == 503,
         "503 once the instance's /health fails", 10)
    status, out = request(f"{px.url}/v1/completions", BODY)
    assert status == 503 and "no healthy instance" in out["error"]["message"]


def test_a_tokenizer_that_cannot_load_is_logged_and_text_prompts_fall_back(backend, fleet,
                                                                            tmp_path):
    """Fails when a bad --tokenizer crashes the router or a text prompt is refused."""
    a, b = backend("a"), backend("b")
    px = fleet("kv", [a.url, b.url], "--tokenizer", str(tmp_path / "no-such-tokenizer"))
    assert "cannot load" in px.log.read_text()
    answers = [request(f"{px.url}/v1/completions", {"model": "m", "prompt": "hello"})
               for _ in range(2)]
    assert [(s, o["backend"]) for s, o in answers] == [(200, "a"), (200, "b")]
    s = stats(px)
    assert [i["by_reason"]["fallback"] for i in s["instances"]] == [1, 1]
    assert s["tokenizer"].startswith("tokenizer ")


def test_affinity_keeps_a_user_on_one_instance(backend, fleet):
    a, b = backend("a"), backend("b")
    px = fleet("affinity", [a.url, b.url])
    got = {request(f"{px.url}/v1/completions", BODY | {"user": u})[1]["backend"]
           for u in ("x", "x", "x")}
    assert len(got) == 1


@pytest.mark.parametrize("argv, message", [
    (["--route", "kv"], "fleet mode needs --route and at least one --instance"),
    (["--route", "kv", "--instance", "http://a:1", "--decoder", "http://d:1"],
     "cannot be mixed"),
    ([], "give --prefiller and --decoder"),
], ids=["no-instance", "mixed", "none"])
def test_mode_mistakes_are_errors_naming_the_flags(argv, message):
    out = subprocess.run([KVHAL, "proxy", "--port", "0", *argv], capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode != 0 and message in out.stderr


def test_the_queue_is_running_plus_waiting_summed_over_label_sets():
    """vLLM's `/metrics` text (two engines' gauges, with HELP/TYPE lines and other gauges
    whose names start alike). Fails when a label set or one of the two gauges is missed."""
    from kvhal.integrations.pd.fleet import parse_queue

    text = b"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 9.0
"""
    assert parse_queue(text) == 6
    assert parse_queue(b"") == 0
