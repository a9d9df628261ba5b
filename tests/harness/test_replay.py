"""The replay through the real engine: exact hits by level, policies, verification, config."""
from __future__ import annotations

import pytest

from kvhal.config import ConfigError
from kvhal.integrations.harness import read_trace, reference_hits
from kvhal.integrations.harness.device_pool import DevicePoolError
from kvhal.integrations.harness.geometry import PRESETS, Geometry, GeometryError
from kvhal.integrations.harness.payload import PayloadMismatchError
from kvhal.integrations.harness.replay import ReplayOptions, run_replay

from .conftest import mooncake

CHUNK = 512
CHUNK_BYTES = 32 << 10  # tiny preset: 64 B/token
BIG_HOST = {"cpu_bytes_to_use": 64 << 20}


def replay(path, config, device_chunks, **kw):
    requests = read_trace(path)
    options = ReplayOptions(PRESETS["tiny"], device_bytes=device_chunks * CHUNK_BYTES, **kw)
    return run_replay(requests, reference_hits(requests, CHUNK), config, options, str(path))


def test_hand_made_trace_hits_by_level(write_trace):
    path = write_trace([
        mooncake([1, 2, 3]),        # miss; stores 1,2,3; device free: 3, c3, c2, c1
        mooncake([1, 2, 4, 5], 1600),  # device hits c1,c2; c4 misses; partial 5 never stored
        mooncake([], 0),            # empty request: no-op
        mooncake([9, 8]),           # misses; reuses blocks of c3 and c4 (evicts them on device)
        mooncake([1, 2, 3]),        # device hits c1,c2; c3 loaded from host
    ])
    report = replay(path, BIG_HOST, device_chunks=4)
    assert report.hit_tokens == {"device": 4 * CHUNK, "host": 1 * CHUNK}
    assert report.total_hit_tokens == report.reference.hit_tokens
    assert report.input_tokens == 2 * 1536 + 1600 + 1024
    assert report.traffic["host"]["d2h"].chunks == 6
    assert report.traffic["host"]["h2d"].chunks == 1
    assert report.traffic["host"]["h2d"].nbytes == CHUNK_BYTES
    assert report.verified_chunks == 5


# One-chunk requests, one device block (no device hits: no request repeats the previous one),
# host capacity 2 chunks.
#   LRU: A B | A hit → [B A] | C evicts B → [A C] | D evicts A → [C D] | A misses.
#   ARC (p = 0): A B in T1 | A hit → T1 [B], T2 [A] | C: |T1| > p evicts B (T1) → T1 [C] |
#        D evicts C (T1) → T1 [D], T2 [A] | A hits.
@pytest.mark.parametrize("policy, host_hits", [("lru", 1), ("arc", 2)])
def test_capacity_limited_lru_vs_arc(write_trace, policy, host_hits):
    path = write_trace([mooncake([i]) for i in (1, 2, 1, 3, 4, 1)])
    config = {"cpu_bytes_to_use": 2 * CHUNK_BYTES, "eviction_policy": policy}
    report = replay(path, config, device_chunks=1)
    assert report.hit_tokens == {"device": 0, "host": host_hits * CHUNK}
    assert report.reference.hit_tokens == 2 * CHUNK


def test_secondary_tier_hits_after_host_eviction(write_trace):
    path = write_trace([mooncake([i]) for i in (1, 2, 3, 1, 2)])
    config = {"cpu_bytes_to_use": 2 * CHUNK_BYTES, "secondary_tiers": [{"type": "memory"}]}
    report = replay(path, config, device_chunks=1)
    # host holds [2 3] when 1 returns: 1 is promoted from memory (evicting 2), then 2 too.
    assert report.hit_tokens == {"device": 0, "host": 0, "memory": 2 * CHUNK}
    assert report.traffic["memory"]["store"].chunks == 3
    assert report.traffic["memory"]["load"].chunks == 2


def test_unlimited_capacity_matches_reference_on_trace_slice(conversation_trace):
    requests = read_trace(conversation_trace, limit=1500)
    reference = reference_hits(requests, CHUNK)
    options = ReplayOptions(PRESETS["tiny"], device_bytes=8 << 20)
    report = run_replay(requests, reference, {"cpu_bytes_to_use": 1 << 30}, options)
    assert report.total_hit_tokens == reference.hit_tokens == 5_659_648
    assert report.hit_tokens["host"] > 0 and report.hit_tokens["device"] > 0
    assert report.verified_chunks == reference.hit_tokens // CHUNK


def test_corrupt_load_is_a_hard_failure(write_trace):
    path = write_trace([mooncake([1, 2]), mooncake([3, 4]), mooncake([1, 2])])
    # host holds 1 chunk: r1 stores 1 (2 does not fit), r2 stores 3; r3 promotes 1 from the
    # faulty tier, whose load flips a byte.
    config = {"cpu_bytes_to_use": 1 * CHUNK_BYTES, "secondary_tiers": [
        {"type": "faulty", "module_path": "tests.harness.faulty_tier:FaultyMemoryTier"}]}
    with pytest.raises(PayloadMismatchError, match=r"trace line 3: chunk 0 \(0000-[0-9a-f]+\) "
                                                   r"from faulty holds wrong bytes in page 0"):
        replay(path, config, device_chunks=2)


def test_chaos_mode_streams_still_verify(write_trace, monkeypatch):
    monkeypatch.setenv("KVHAL_CPU_CHAOS", "7")
    path = write_trace([mooncake([1, 2, 3]), mooncake([4, 5, 6]), mooncake([1, 2, 3])])
    report = replay(path, BIG_HOST, device_chunks=3)
    assert report.hit_tokens == {"device": 0, "host": 3 * CHUNK}


def test_max_offload_tokens_caps_what_is_stored(write_trace):
    path = write_trace([mooncake([1, 2, 3]), mooncake([7, 8, 9]), mooncake([1, 2, 3])])
    report = replay(path, dict(BIG_HOST, max_offload_tokens=1024), device_chunks=3)
    assert report.hit_tokens == {"device": 0, "host": 2 * CHUNK}


def test_request_larger_than_device_pool_names_the_option(write_trace):
    with pytest.raises(DevicePoolError, match="--device-bytes: 65536 bytes hold 2 chunks of "
                                              "32768 bytes, but a request has 3 full chunks"):
        replay(write_trace([mooncake([1, 2, 3])]), BIG_HOST, device_chunks=2)


def test_chunk_other_than_the_trace_block_is_refused(write_trace):
    with pytest.raises(ConfigError, match="blocks_per_chunk: a replay's chunk is the trace's "
                                          r"block \(512 tokens\)"):
        replay(write_trace([mooncake([1])]), dict(BIG_HOST, blocks_per_chunk=2),
               device_chunks=1)


def test_time_scale_paces_requests(write_trace):
    path = write_trace([mooncake([1], ts=0), mooncake([2], ts=300)])
    report = replay(path, BIG_HOST, device_chunks=1, time_scale=1.0)
    assert report.wall_s >= 0.3


@pytest.mark.parametrize("layout", ["packed-hnd", "packed-nhd", "split-nhd", "separate-kv",
                                    "vllm-cpu"])
def test_device_layouts_and_multi_layer_pages_verify(write_trace, layout):
    geometry = Geometry(3, 2, 8, "bfloat16")  # 3 layers × 2 heads × (K+V) × 8 × 2 B = 192 B/token
    path = write_trace([mooncake([1, 2]), mooncake([3, 4]), mooncake([1, 2])])
    requests = read_trace(path)
    options = ReplayOptions(geometry, device_bytes=2 * 512 * 192, layout=layout)
    report = run_replay(requests, reference_hits(requests, CHUNK), BIG_HOST, options)
    assert report.chunk_bytes == 512 * 192
    assert report.hit_tokens == {"device": 0, "host": 2 * CHUNK}
    assert report.verified_chunks == 2


@pytest.mark.parametrize("args, message", [
    ((0, 1, 16, "float16"), "--layers: must be a positive int, got 0"),
    ((1, 1, -2, "float16"), "--head-size: must be a positive int, got -2"),
    ((1, 1, 16, "int4"), "--dtype: unknown dtype 'int4'"),
], ids=["layers", "head-size", "dtype"])
def test_bad_geometry_names_the_flag(args, message):
    with pytest.raises(GeometryError, match=message):
        Geometry(*args)


def test_two_tiers_of_one_type_are_reported_apart(write_trace):
    path = write_trace([mooncake([i]) for i in (1, 2, 3, 1)])
    config = {"cpu_bytes_to_use": 2 * CHUNK_BYTES, "secondary_tiers": [
        {"type": "memory"}, {"type": "memory"}]}
    report = replay(path, config, device_chunks=1)
    # 1 left the host (capacity 2) when 3 was stored; both tiers hold it, the first one serves.
    assert report.hit_tokens == {"device": 0, "host": 0, "memory[0]": CHUNK, "memory[1]": 0}
    assert report.traffic["memory[1]"]["store"].chunks == 3


P2P = {"type": "p2p", "auth_key": "kvhal-test-p2p-shared-key", "timeout_s": 10.0}


def test_two_instances_hit_each_others_host_over_p2p(write_trace):
    # Round robin: r0, r2 on instance 0; r1, r3 on instance 1 (device pools of 8 chunks).
    path = write_trace([
        mooncake([1, 2, 3]),           # i0: misses; host0 gets 1,2,3
        mooncake([1, 2, 3, 4]),        # i1: 1,2,3 pulled from i0 (p2p); 4 misses
        mooncake([1, 2, 3, 4, 5]),     # i0: 1,2,3 on its device; 4 from i1 (p2p); 5 misses
        mooncake([1, 2, 3, 4, 5, 6]),  # i1: 1..4 on its device; 5 from i0 (p2p); 6 misses
    ])
    config = {"cpu_bytes_to_use": 64 << 20, "secondary_tiers": [P2P]}
    report = replay(path, config, device_chunks=8, instances=2)
    assert report.hit_tokens == {"device": 7 * CHUNK, "host": 0, "p2p": 5 * CHUNK}
    assert report.traffic["p2p"]["load"].chunks == 5
    assert report.verified_chunks == 12
    assert report.instances == 2


def test_instances_refuse_a_configured_p2p_port(write_trace):
    path = write_trace([mooncake([1])])
    config = {"cpu_bytes_to_use": 64 << 20, "secondary_tiers": [P2P | {"port": 9999}]}
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.port: set by the replay"):
        replay(path, config, device_chunks=8, instances=2)
