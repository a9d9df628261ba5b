"""vLLM's real `Scheduler` drives kvhal's scheduler side and worker side (`rig.Rig`) through
each load path; a second request with the same prompt, after vLLM's own prefix cache was
reset and the device KV zeroed, must get every reused token from kvhal, byte for byte, with
vLLM's `PrefixCacheStats.hits_by_source` (the `connector_prefix_cache_stats` of its
`SchedulerStats`) and kvhal's connector stats saying where from.

Not on vLLM 0.34 (`conftest.ENGINE_REFUSED`). Checked to fail: with every hit source of
`KVHalConnector.get_external_cache_hit_sources` mapped to "disk" the host tests fail; with
`WorkerSide.start_load_kv` issuing no load all four fail (nothing loaded, asynchronous loads
never end); with a synchronous load's block ids reversed the byte comparison fails.
"""
from __future__ import annotations

import collections

import pytest
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .rig import Rig, pattern, prompt, state_pattern

pytestmark = pytest.mark.engine

HOST_ONLY = {"cpu_bytes_to_use": 32 << 20}


def _reload(rig: Rig, tokens: list[int], *, clear_host: bool = False) -> list:
    """Run request "a" of `tokens`, forget it everywhere but kvhal (vLLM's prefix cache reset,
    the device KV zeroed; `clear_host` also drops kvhal's host tier), run "b" of the same
    tokens; the `SchedulerStats` of b's steps.

    Before the host tier is dropped, the secondary tiers' stores of a's chunks are drained: the
    cascade to fs runs after the host store, and dropping the host first (seen in a loaded CI
    run: b got 0 hits) leaves fs nothing to promote — a correct miss, not the path under test.
    """
    rig.add("a", tokens)
    rig.run()
    assert rig.scheduler.reset_prefix_cache()
    if clear_host:
        rig.connector.scheduler_side.manager.drain(timeout_s=120)
        rig.connector.reset_cache()
    for tensor in rig.kv_caches.values():
        tensor.zero_()
    first = len(rig.stats)
    rig.add("b", tokens)
    rig.run()
    return rig.stats[first:]


def _hits(stats: list) -> tuple[int, dict]:
    """(hit tokens, hits_by_source) vLLM recorded for the connector over `stats`."""
    hits, sources = 0, collections.Counter()
    for s in stats:
        hits += s.connector_prefix_cache_stats.hits
        sources.update(s.connector_prefix_cache_stats.hits_by_source)
    return hits, dict(sources)


def _counter(stats: list, name: str) -> dict:
    """kvhal's connector-stats counter `name` summed over `stats`, by label."""
    out = collections.Counter()
    for s in stats:
        out.update((s.kv_connector_stats or {}).get("counters", {}).get(name, {}))
    return dict(out)


def _assert_rows(rig: Rig, tokens: list[int], layers: list[str], positions: range) -> None:
    """b's attention rows at `positions` of `layers` hold what a's forward wrote there."""
    for name in layers:
        layer, group = rig.layer_index[name], rig.group_of[name]
        blocks = rig.blocks["b"][group]
        for p in positions:
            row = rig.attention_row(name, blocks[p // rig.block_size], p % rig.block_size)
            assert (row == pattern(tokens[p], p, layer)).all(), (name, p)


@pytest.fixture
def rig_of():
    rigs = []

    def make(kind: str, config: dict, layout: str = "LBHNC") -> Rig:
        rigs.append(Rig(kind, config, layout))
        return rigs[-1]

    yield make
    for rig in rigs:
        rig.close()


# vLLM 0.33 picks LBNHC (NHD) by default, HND (LBHNC) where a backend prefers it; the pages of
# every layout are checked by test_gpu_layouts.py.
LAYOUTS = ["LBHNC", "LBNHC"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_synchronous_load_from_the_host_tier(rig_of, layout):
    rig = rig_of("full", HOST_ONLY, layout)
    tokens = prompt(0, 100)
    stats = _reload(rig, tokens)
    # 6 full 16-token blocks before the last prompt token; one group: a synchronous load.
    assert _hits(stats) == (96, {CacheHitSource.HOST: 96})
    assert _counter(stats, "loaded_chunks") == {"host": 6}
    assert rig.worker_steps[-len(stats)]["sync_loads"]
    _assert_rows(rig, tokens, list(rig.specs), range(96))


def test_asynchronous_load_of_sliding_window_and_full_groups(rig_of):
    rig = rig_of("swa", HOST_ONLY)
    tokens = prompt(1, 100)
    stats = _reload(rig, tokens)
    steps = rig.worker_steps[-len(stats):]
    assert _hits(stats) == (96, {CacheHitSource.HOST: 96})
    # Full layers: all 6 blocks; sliding layers (32 tokens): the 2 blocks under the window.
    assert _counter(stats, "loaded_chunks") == {"host": 8}
    assert not any(s["sync_loads"] for s in steps)
    assert any("b" in s["recving"] for s in steps)
    full = [n for n in rig.specs if rig.layer_index[n] % 2]
    sliding = [n for n in rig.specs if not rig.layer_index[n] % 2]
    _assert_rows(rig, tokens, full, range(96))
    _assert_rows(rig, tokens, sliding, range(64, 96))


def test_asynchronous_promotion_from_the_fs_tier(rig_of, tmp_path):
    rig = rig_of("full", HOST_ONLY | {"secondary_tiers": [{"type": "fs",
                                                          "root_dir": str(tmp_path)}]})
    tokens = prompt(2, 100)
    stats = _reload(rig, tokens, clear_host=True)
    steps = rig.worker_steps[-len(stats):]
    assert _hits(stats) == (96, {CacheHitSource.DISK: 96})
    assert _counter(stats, "loaded_chunks").get("fs", 0) == 6   # fs → host, then host → device
    assert any("b" in s["recving"] for s in steps)
    _assert_rows(rig, tokens, list(rig.specs), range(96))


def test_state_group_resumes_from_the_stored_state(rig_of):
    rig = rig_of("hybrid", HOST_ONLY)
    tokens = prompt(3, 200)
    stats = _reload(rig, tokens)
    # 2 full 80-token blocks; the state kept is the one at token 160.
    assert _hits(stats) == (160, {CacheHitSource.HOST: 160})
    state_layers = [n for n, g in rig.group_of.items()
                    if type(rig.specs[n]).__name__ == "MambaSpec"]
    for name in state_layers:
        block = rig.blocks["b"][rig.group_of[name]][1]
        assert (rig.state_page(name, block) == state_pattern(160, rig.layer_index[name])).all()
    _assert_rows(rig, tokens, [n for n in rig.specs if n not in state_layers], range(160))
