"""`kvhal proxy` as its own process, in front of recording backends (real HTTP servers that
record the exact legs; `servers.py`). What vLLM does with the legs: tests/vllm/test_proxy.py.
"""
from __future__ import annotations

import http.client
import json
import signal
import socket
import time
import urllib.parse

import pytest

from kvhal.integrations.pd.legs import RemotePrefill, decode_body, prefill_body

from .servers import FaultyBackend, ProxyProcess, SSEStream, request

CLIENT = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 16, "temperature": 0,
          "kv_transfer_params": {"max_offload_tokens": 128}}
P2P = ("10.1.2.3", 7100)


@pytest.fixture
def proxy(proxy_process):
    """Factory: `proxy(prefillers, decoders, *args)` starts `kvhal proxy` in front of them."""
    def start(prefillers, decoders, *args: str, p2p=P2P) -> ProxyProcess:
        argv = [a for p in prefillers for a in ("--prefiller", f"{p.url},{p2p[0]}:{p2p[1]}")]
        argv += [a for d in decoders for a in ("--decoder", d.url)]
        return proxy_process("proxy", *argv, *args)
    return start


def _wait(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def _id(leg) -> str:
    return leg.body["kv_transfer_params"]["remote_decoder"]["kv_request_id"]


def test_each_request_sends_both_legs_under_a_fresh_unguessable_id(backend, proxy):
    """The prefiller gets `legs.prefill_body`, the decoder `legs.decode_body` naming the
    prefiller's p2p address and the same id; ids differ between requests; the client gets
    the decoder's answer unchanged. Fails when the id is reused or predictable (e.g. a
    counter: it would not be 32 urlsafe characters), or a leg's body is off."""
    p, d = backend("p"), backend("d")
    px = proxy([p], [d])
    answers = [request(f"{px.url}/v1/completions", CLIENT) for _ in range(2)]
    ids = [_id(leg) for leg in p.legs]
    assert len(set(ids)) == 2 and all(len(i) == 32 for i in ids)
    assert all(c.isalnum() or c in "-_" for i in ids for c in i)
    for i, (status, answer) in enumerate(answers):
        assert p.legs[i].body == prefill_body(CLIENT, ids[i], chat=False)
        want = decode_body(CLIENT, RemotePrefill(ids[i], *P2P))
        assert d.legs[i].body == want
        assert (status, answer) == (200, {"backend": "d", "echo": want})


def test_chat_completions_go_to_the_chat_route_of_both(backend, proxy):
    """Fails when a chat request's legs go to /v1/completions or the prefill leg leaves
    `max_completion_tokens` to the client."""
    p, d = backend("p"), backend("d")
    px = proxy([p], [d])
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 9}
    status, _ = request(f"{px.url}/v1/chat/completions", body)
    assert status == 200
    assert [leg.path for leg in p.legs + d.legs] == ["/v1/chat/completions"] * 2
    assert p.legs[0].body == prefill_body(body, _id(p.legs[0]), chat=True)


def test_prefill_first_sends_the_decode_leg_after_the_prefill_answer(backend, proxy):
    """The prefiller holds its answer until the decoder got a request (2 s at most): in
    prefill-first the decode leg arrives only after that answer. Fails with the decode leg
    sent without waiting (e.g. `--order concurrent`'s code path)."""
    p, d = backend("p"), backend("d")
    p.answer_after = (d, 2.0)
    px = proxy([p], [d], "--order", "prefill-first")
    assert request(f"{px.url}/v1/completions", CLIENT)[0] == 200
    assert p.legs[0].waited_ok is False
    assert p.legs[0].answered_seq < d.legs[0].seq


def test_concurrent_sends_both_legs_before_either_answers(backend, proxy):
    """Each backend holds its answer until the other got its leg (30 s at most): both waits
    end by the other's arrival. Fails in prefill-first order (the prefiller's wait times
    out), e.g. with `Order.CONCURRENT` mapped to the prefill-first branch."""
    p, d = backend("p"), backend("d")
    p.answer_after, d.answer_after = (d, 30.0), (p, 30.0)
    px = proxy([p], [d], "--order", "concurrent")
    assert request(f"{px.url}/v1/completions", CLIENT)[0] == 200
    _wait(lambda: p.legs[0].answered_seq is not None)   # it may answer after the client's
    assert (p.legs[0].waited_ok, d.legs[0].waited_ok) == (True, True)


def test_decode_first_sends_the_prefill_leg_after_the_decode_leg_arrived(backend, proxy):
    """The decoder holds its answer until the prefiller got its leg (as a P/D decoder waits
    for KV): the decode leg arrives first, and the prefill leg still goes out. Fails with
    the prefill leg sent first (prefill-first: the decoder's wait would also time out)."""
    p, d = backend("p"), backend("d")
    d.answer_after = (p, 30.0)
    px = proxy([p], [d], "--order", "decode-first")
    assert request(f"{px.url}/v1/completions", CLIENT)[0] == 200
    assert d.legs[0].waited_ok is True
    assert d.legs[0].seq < p.legs[0].seq


def test_streamed_events_reach_the_client_one_by_one(backend, proxy):
    """The decoder sends its next SSE event only after the client read the previous one
    through the proxy: a proxy buffering the stream would hold event 0 and the read time out.
    Fails when the relay reads the whole upstream body before writing (e.g. `await
    upstream.read()`)."""
    p, d = backend("p"), backend("d")
    px = proxy([p], [d])
    stream = SSEStream(f"{px.url}/v1/completions", CLIENT | {"stream": True}, timeout_s=20)
    try:
        assert stream.resp.status == 200
        assert stream.resp.getheader("Content-Type") == "text/event-stream"
        events = [stream.next_event()]
        for _ in range(2):
            d.release()
            events.append(stream.next_event())
        events.append(stream.next_event())
    finally:
        stream.close()
    assert events == [json.dumps({"backend": "d", "n": i}) for i in range(3)] + ["[DONE]"]
    assert p.legs[0].body["stream"] is False and d.legs[0].body["stream"] is True


def test_dp_ranks_get_pinned_legs_and_their_own_p2p_ports(backend, proxy):
    """A prefiller with 2 data-parallel ranks: legs alternate ranks 0 and 1 by vLLM's
    `X-data-parallel-rank` header, and each decode leg names port 7100 + that rank. Fails
    when `remote_port` ignores the rank."""
    p, d = backend("p"), backend("d")
    px = proxy([], [d], "--prefiller", f"{p.url},{P2P[0]}:{P2P[1]},2")
    for _ in range(4):
        assert request(f"{px.url}/v1/completions", CLIENT)[0] == 200
    assert [leg.headers.get("X-data-parallel-rank") for leg in p.legs] == ["0", "1", "0", "1"]
    ports = [leg.body["kv_transfer_params"]["remote_prefiller"]["remote_port"]
             for leg in d.legs]
    assert ports == [7100, 7101, 7100, 7101]


def test_one_request_at_a_time_alternates_backends(backend, proxy):
    """Fails when selection always picks the first backend (no round-robin among ties)."""
    p1, p2, d1, d2 = backend("p1"), backend("p2"), backend("d1"), backend("d2")
    px = proxy([p1, p2], [d1, d2])
    for _ in range(4):
        assert request(f"{px.url}/v1/completions", CLIENT)[0] == 200
    assert [len(b.legs) for b in (p1, p2, d1, d2)] == [2, 2, 2, 2]


def test_a_busy_decoder_is_passed_over(backend, proxy):
    """d1 holds a stream open: the next two requests both go to d2 (least outstanding).
    Fails with plain round-robin (the second would go to d1)."""
    p, d1, d2 = backend("p"), backend("d1"), backend("d2")
    px = proxy([p], [d1, d2])
    stream = SSEStream(f"{px.url}/v1/completions", CLIENT | {"stream": True}, timeout_s=20)
    try:
        stream.next_event()
        for _ in range(2):
            assert request(f"{px.url}/v1/completions", CLIENT)[1]["backend"] == "d2"
        d1.release(), d1.release()
        assert [stream.next_event() for _ in range(3)][-1] == "[DONE]"
    finally:
        stream.close()
    assert (len(d1.legs), len(d2.legs)) == (1, 2)


def test_health_reports_each_backend_and_unhealthy_ones_are_skipped(backend, proxy):
    """d1's /health answers 503: the proxy's /health says so, and requests go to d2 until
    d1 is healthy again. Fails when polls are ignored in selection."""
    p, d1, d2 = backend("p"), backend("d1"), backend("d2")
    px = proxy([p], [d1, d2], "--health-interval-s", "0.2")
    d1.health_status = 503
    state = px.wait_health(lambda s: s["decoders"][0]["healthy"] is False)
    assert state["decoders"][0]["last_error"] == "/health answered HTTP 503"
    assert state["decoders"][1]["healthy"] is True and state["prefillers"][0]["healthy"]
    assert state["prefillers"][0]["p2p"] == "10.1.2.3:7100"
    for _ in range(3):
        assert request(f"{px.url}/v1/completions", CLIENT)[1]["backend"] == "d2"
    d1.health_status = 200
    px.wait_health(lambda s: s["decoders"][0]["healthy"] is True)
    assert {request(f"{px.url}/v1/completions", CLIENT)[1]["backend"]
            for _ in range(2)} == {"d1", "d2"}


def test_a_down_decoder_gives_502_then_503_naming_it(backend, proxy):
    """The only decoder stops before the proxy polled it again (polls 1 h apart): the
    request gets 502 naming the decoder and the failure; then the decoder is unhealthy and
    requests get 503 naming it, and so does /health. No traceback in any body."""
    p, d = backend("p"), backend("d")
    px = proxy([p], [d], "--health-interval-s", "3600")
    d.stop()
    status, answer = request(f"{px.url}/v1/completions", CLIENT)
    assert status == 502
    err = answer["error"]
    assert err["backend"] == d.url and err["code"] == 502 and err["type"] == "kvhal_proxy_error"
    assert err["message"].startswith(f"decoder {d.url} unreachable: ClientConnectorError")
    status, answer = request(f"{px.url}/v1/completions", CLIENT)
    assert status == 503
    assert answer["error"]["message"].startswith(f"no healthy decoder: {d.url} (")
    assert px.health()[0] == 503
    assert "Traceback" not in px.log.read_text()


def test_a_failing_prefill_leg_decodes_without_remote_prefiller(backend, proxy):
    """prefill-first, the prefiller answers 500: the decode leg goes out without
    `remote_prefiller` (the decoder computes the prompt) and the client gets its answer; the
    failure is counted. Fails when the decode leg still names the prefiller."""
    p, d = backend("p", FaultyBackend, status=500), backend("d")
    px = proxy([p], [d])
    status, answer = request(f"{px.url}/v1/completions", CLIENT)
    assert (status, answer["backend"]) == (200, "d")
    assert d.legs[0].body == decode_body(CLIENT, None)
    assert px.health()[1]["prefillers"][0]["failures"] == 1


def test_a_refused_prefill_leg_is_the_answer(backend, proxy):
    """prefill-first, the prefiller answers 400 (the request is bad): the client gets that
    answer and no decode leg is sent. Fails when 4xx is treated like 5xx."""
    p, d = backend("p", FaultyBackend, status=400), backend("d")
    px = proxy([p], [d])
    status, answer = request(f"{px.url}/v1/completions", CLIENT)
    assert (status, answer) == (400, {"error": {"message": "p refuses", "code": 400}})
    assert d.legs == []


def test_no_reachable_prefiller_still_answers(backend, proxy):
    """The prefiller is down: prefill-first decodes without it; once it is marked
    unhealthy, requests skip the prefill leg. Fails when a down prefiller fails requests."""
    p, d = backend("p"), backend("d")
    px = proxy([p], [d], "--health-interval-s", "3600")
    p.stop()
    for _ in range(2):
        assert request(f"{px.url}/v1/completions", CLIENT)[0] == 200
    assert [leg.body for leg in d.legs] == [decode_body(CLIENT, None)] * 2
    prefiller = px.health()[1]["prefillers"][0]
    assert prefiller["healthy"] is False and prefiller["legs"] == 1
    assert prefiller["last_error"].startswith("ClientConnectorError")


@pytest.mark.parametrize("body, message", [
    (b"{not json", "request body is not valid JSON"),
    (b"[1, 2]", "request body must be a JSON object, got list"),
    (json.dumps({"prompt": [1], "kv_transfer_params": 5}).encode(),
     "kv_transfer_params: must be a JSON object, got int")],
    ids=["not-json", "not-object", "params"])
def test_bad_bodies_get_400_naming_the_problem(backend, proxy, body, message):
    """Fails when a bad body reaches a backend or is answered without saying why."""
    p, d = backend("p"), backend("d")
    px = proxy([p], [d])
    parts = urllib.parse.urlsplit(px.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    answer = json.loads(resp.read())
    conn.close()
    assert resp.status == 400 and answer["error"]["message"].startswith(message)
    assert p.legs == d.legs == []


def test_models_come_from_a_decoder(backend, proxy):
    """Fails when /v1/models is not routed to a decoder."""
    p, d = backend("p"), backend("d")
    px = proxy([p], [d])
    assert request(f"{px.url}/v1/models") == (200, {"backend": "d"})


def test_a_decoder_dying_mid_stream_leaves_the_client_an_incomplete_body(backend, proxy):
    """The decoder stops after its first event: the client's read fails instead of seeing
    a cleanly ended (truncated) stream. Fails when the relay ends the response normally
    after an upstream error (e.g. with `request.transport.abort()` removed)."""
    p, d = backend("p"), backend("d")
    px = proxy([p], [d])
    stream = SSEStream(f"{px.url}/v1/completions", CLIENT | {"stream": True}, timeout_s=20)
    try:
        stream.next_event()
        d.stop()
        with pytest.raises((http.client.IncompleteRead, ConnectionError)):
            stream.next_event()
    finally:
        stream.close()


def _refused(url: str) -> bool:
    parts = urllib.parse.urlsplit(url)
    try:
        socket.create_connection((parts.hostname, parts.port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def test_sigterm_finishes_the_stream_in_flight_then_exits_0(backend, proxy):
    """SIGTERM while a stream is open: the listener closes at once, the open stream still
    completes though its decoder holds it 1 s more, then the proxy exits 0. Fails when
    shutdown cuts requests in flight (e.g. aiohttp's `shutdown_timeout` set to 0.01 s)."""
    p, d = backend("p"), backend("d")
    px = proxy([p], [d])
    stream = SSEStream(f"{px.url}/v1/completions", CLIENT | {"stream": True}, timeout_s=20)
    try:
        assert stream.next_event() == json.dumps({"backend": "d", "n": 0})
        px.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while not _refused(px.url):
            assert time.monotonic() < deadline, "the proxy kept listening after SIGTERM"
            time.sleep(0.05)
        time.sleep(1.0)     # the stream outlives the listener by 1 s: a cut would come now
        d.release(), d.release()
        assert [stream.next_event() for _ in range(3)][-1] == "[DONE]"
    finally:
        stream.close()
    assert px.proc.wait(30) == 0


def test_a_client_leaving_mid_stream_closes_both_legs(backend, proxy):
    """concurrent order, the prefiller holding its answer: the client drops its stream after
    the first event while the decoder has nothing more to send. The proxy closes its
    connections to the decoder and the prefiller at once (vLLM aborts a request whose
    connection closes) and counts no leg as outstanding. Fails without aiohttp's
    `handler_cancellation` (the relay waits for the decoder's next event before noticing),
    or when a cancelled prefill leg stays counted."""
    p, d = backend("p"), backend("d")
    p.answer_after = (backend("never"), 30.0)
    px = proxy([p], [d], "--order", "concurrent")
    stream = SSEStream(f"{px.url}/v1/completions", CLIENT | {"stream": True}, timeout_s=20)
    stream.next_event()
    _wait(lambda: p.legs)
    stream.close()
    # both backends hold their legs 30 s: only the proxy can close them before that
    _wait(lambda: d.connection_closed(d.legs[0]) and p.connection_closed(p.legs[0]),
          timeout_s=20)
    assert d.legs[0].answered_seq is None and p.legs[0].answered_seq is None
    state = px.wait_health(lambda s: s["prefillers"][0]["outstanding"] == 0)
    assert state["decoders"][0]["outstanding"] == 0
    assert "Traceback" not in px.log.read_text()


def test_a_slow_prefill_leg_times_out_and_the_decoder_computes(backend, proxy):
    """prefill-first with `--prefill-timeout-s 1`, the prefiller holding its answer 30 s:
    after 1 s the decode leg goes out without `remote_prefiller`; the prefiller stays
    healthy (slow, not down). Fails when the prefill leg has no deadline (the request takes
    the full 30 s, over this test's 20 s client timeout)."""
    p, d = backend("p"), backend("d")
    p.answer_after = (backend("never"), 30.0)
    px = proxy([p], [d], "--prefill-timeout-s", "1")
    status, answer = request(f"{px.url}/v1/completions", CLIENT, timeout_s=20)
    assert status == 200 and d.legs[0].body == decode_body(CLIENT, None)
    prefiller = px.health()[1]["prefillers"][0]
    assert (prefiller["healthy"], prefiller["failures"]) == (True, 1)


def test_a_body_over_aiohttps_1_mib_default_passes(backend, proxy):
    """A 400,000-token prompt (2.6 MB of JSON) reaches both legs. Fails with aiohttp's
    default `client_max_size` (413)."""
    p, d = backend("p"), backend("d")
    px = proxy([p], [d])
    body = CLIENT | {"prompt": list(range(100_000, 500_000))}
    status, answer = request(f"{px.url}/v1/completions", body)
    assert status == 200 and answer["echo"]["prompt"] == body["prompt"]
    assert p.legs[0].body["prompt"] == body["prompt"]
