"""The cost model (`kvhal/engine/cost.py`): a secondary tier's hit loads only while its
predicted load beats the predicted recompute; host hits always load; bad values refused."""
from __future__ import annotations

import logging

import pytest

from kvhal.config import ConfigError, CostModelConfig, TierCost, parse_config
from kvhal.engine.cost import CostModel, LinkEstimate, PrefillEstimate
from kvhal.tier import JobKind, Lookup

from .rig import chunk_blocks, make_rig, synthetic_keys

HIT, MISS, RETRY = Lookup.HIT, Lookup.MISS, Lookup.RETRY
TPC = 256                       # tokens per chunk
CHUNK = 2 * 512                 # the rig's chunk bytes (2 blocks of 512)
#: Recompute of n chunks: n * 256 / 1000 = 0.256 n s.
PREFILL = 1000.0


def _rig(cost_model, capacity=16):
    return make_rig(capacity=capacity, blocks_per_chunk=2, block_bytes=512, num_blocks=64,
                    tiers=[{"type": "memory"}], tokens_per_chunk=TPC,
                    config={} if cost_model is None else {"cost_model": cost_model})


def _tier_only(rig, n_host: int, n: int = 6):
    """n keys stored (cascaded to the memory tier), then only the first `n_host` back in
    host memory."""
    keys = synthetic_keys(n)
    rig.store(keys, chunk_blocks(0, n, 2))
    rig.manager.drain()
    rig.manager.clear()
    if n_host:
        rig.store(keys[:n_host], chunk_blocks(0, n_host, 2))
    return keys


def _model(bandwidth: float, latency: float = 0.0, **more) -> dict:
    return {"prefill_tokens_per_s": PREFILL, **more,
            "tiers": {"memory": {"bandwidth_bytes_per_s": bandwidth, "latency_s": latency}}}


def test_a_tier_slower_than_recompute_is_skipped_and_host_hits_still_load(caplog):
    """4 tier chunks: load 4 × 1024 B / 1000 B/s = 4.1 s vs recompute 1.02 s → MISS from the
    first tier chunk; the 2 host chunks still HIT. The skip counts 4 × 256 tokens once per
    request, and one debug line says why."""
    rig = _rig(_model(1000.0))
    try:
        keys = _tier_only(rig, 2)
        with caplog.at_level(logging.DEBUG, "kvhal.engine.cost"):
            assert rig.manager.lookup(keys, request_id="r") == [HIT, HIT] + [MISS] * 4
        assert rig.manager.lookup(keys, request_id="r") == [HIT, HIT] + [MISS] * 4
        assert rig.manager.stats()["tier_jobs"] == 0
        counters = rig.manager.metrics.take_delta()["counters"]
        assert counters["cost_skipped_tokens"] == {"memory": 4 * TPC}
        (line,) = [r.getMessage() for r in caplog.records]
        assert line.startswith("cost model: memory tier, 4 chunks (1024 tokens): load 4.0960 s "
                               "vs recompute 1.0240 s") and line.endswith("-> recompute")
    finally:
        rig.close()


@pytest.mark.parametrize("cost_model", [
    _model(1e9),                       # a fast tier: 4 µs vs 1 s
    "always",                          # the model off, however slow the tier
    {"mode": "always", **_model(1.0)},
    None,                              # default on, but nothing measured or configured yet
], ids=["fast-tier", "always", "always-object", "unmeasured"])
def test_a_tier_hit_loads_when_it_pays_or_the_model_is_off(cost_model):
    rig = _rig(cost_model)
    try:
        keys = _tier_only(rig, 2)
        assert rig.manager.lookup(keys, request_id="r") == [HIT, HIT] + [RETRY] * 4
        rig.manager.drain()
        assert rig.manager.lookup(keys, request_id="r") == [HIT] * 6
        assert "cost_skipped_tokens" not in rig.manager.metrics.take_delta()["counters"]
    finally:
        rig.close()


def test_the_margin_asks_a_load_to_be_that_much_faster():
    """4 chunks at 4096 B/s: load 1.0 s vs recompute 1.024 s: loads with margin 0, not with
    the default 0.1 (1.1 s > 1.024 s)."""
    for margin, answer in ((0.0, RETRY), (0.1, MISS)):
        rig = _rig(_model(4096.0, margin=margin))
        try:
            keys = _tier_only(rig, 2)
            assert rig.manager.lookup(keys)[2] is answer
        finally:
            rig.close()


def test_a_skipped_tier_is_probed_in_the_background_every_probe_every_skips():
    """Every 3rd skip promotes the run's last chunk, owned by nobody: no answer changes (the
    request still recomputes), the chunk lands cold, and the estimate is measured again. The
    memory tier is far faster than the 1000 B/s configured: each probe halves the believed
    seconds per byte (6 chunks: 6.1 s, 3.1 s, 1.5 s, 0.8 s vs 1.5 s recompute), so the 10th
    lookup, after the 3rd probe, loads."""
    rig = _rig(_model(1000.0, probe_every=3))
    try:
        keys = _tier_only(rig, 0)
        jobs, answers = [], []
        for _ in range(12):
            rig.manager.clear()                  # the probed chunk too: a tier-only prefix
            answers.append(rig.manager.lookup(keys)[0])
            jobs.append(rig.manager.stats()["tier_jobs"])
            rig.manager.drain()
            if answers[-1] is RETRY:
                break
        assert answers == [MISS] * 9 + [RETRY]
        assert jobs == [0, 0, 1] * 3 + [6]
    finally:
        rig.close()


def test_a_busy_period_gives_latency_and_bandwidth():
    """8 chunks of 1 MB submitted at t=0, the last collected at t=2.1 s, the fastest job
    0.35 s: with 4 MB/s believed, latency = 0.35 − 0.25 = 0.1 s and bandwidth = 8 MB / 2 s
    = 4 MB/s; the figures blend as seconds per byte (a second period at 1 MB/s → 1.6 MB/s)."""
    link = LinkEstimate(TierCost(4e6, 0.1))
    for _ in range(8):
        link.started(0.0)
    for i in range(8):
        link.finished(1_000_000, 0.35 + i, True, 2.1)
    assert link.latency_s == pytest.approx(0.1)
    assert link.bandwidth_bytes_per_s == pytest.approx(4e6)
    link.started(10.0)
    link.finished(1_000_000, 1.1, True, 11.1)
    assert link.bandwidth_bytes_per_s == pytest.approx(1 / ((0.25e-6 + 1e-6) / 2))


def test_prefill_throughput_is_kept_per_band_of_tokens():
    est = PrefillEstimate(500.0)
    assert est.tokens_per_s(2048) == 500.0                 # the configured start
    est.observe(2000, 2.0)                                 # band 10: 1000 tokens/s
    est.observe(16, 0.04)                                  # band 4: 400 tokens/s
    assert est.tokens_per_s(1500) == 1000.0
    assert est.tokens_per_s(20) == 400.0
    assert est.tokens_per_s(100_000) == 1000.0             # the nearest band timed
    est.observe(1024, 0.512)                               # band 10 again: 2000 → blended
    assert est.tokens_per_s(1024) == 1500.0


@pytest.mark.parametrize("value,path", [
    ({"tiers": {"obj": {"bandwidth_bytes_per_s": -5}}}, "cost_model.tiers.obj.bandwidth_bytes_per_s"),
    ({"tiers": {"obj": {"bandwidth_bytes_per_s": 0}}}, "cost_model.tiers.obj.bandwidth_bytes_per_s"),
    ({"tiers": {"obj": {"latency_s": -1}}}, "cost_model.tiers.obj.latency_s"),
    ({"tiers": {"obj": {"rtt": 1}}}, "cost_model.tiers.obj.rtt"),
    ({"prefill_tokens_per_s": 0}, "cost_model.prefill_tokens_per_s"),
    ({"prefill_tokens_per_s": float("nan")}, "cost_model.prefill_tokens_per_s"),
    ({"margin": -0.1}, "cost_model.margin"),
    ({"probe_every": 0}, "cost_model.probe_every"),
    ({"mode": "never"}, "cost_model.mode"),
    ("sometimes", "cost_model.mode"),
    ({"speed": 1}, "cost_model.speed"),
    (3, "cost_model"),
], ids=lambda v: str(v)[:40])
def test_bad_cost_model_values_are_refused_naming_the_key(value, path):
    with pytest.raises(ConfigError) as err:
        parse_config({"cpu_bytes_to_use": 1 << 20, "cost_model": value})
    assert err.value.path == path


def test_the_default_is_the_model_and_always_turns_it_off():
    assert parse_config({"cpu_bytes_to_use": 1}).cost_model == CostModelConfig()
    assert CostModelConfig().mode == "model"
    assert parse_config({"cpu_bytes_to_use": 1, "cost_model": "always"}).cost_model.mode \
        == "always"
    assert not CostModel(CostModelConfig("always"), ["obj"], 256).enabled


def test_a_cost_for_a_tier_label_no_tier_has_is_refused_at_start():
    with pytest.raises(ConfigError) as err:
        _rig({"tiers": {"obj": {"bandwidth_bytes_per_s": 1e6}}})
    assert err.value.path == "cost_model.tiers.obj"
    assert "labels: memory" in str(err.value)


def test_a_tier_whose_loads_are_unmeasured_is_judged_by_its_stores():
    """No promotion measured, none configured: its cascades' 1 MB/s stands in (8 chunks of
    1 MB: 8 s against 2048 tokens at 1000 tokens/s, 2 s → recompute); once a promotion is
    measured (fast), the loads' estimate decides."""
    model = CostModel(CostModelConfig(prefill_tokens_per_s=PREFILL), ["obj"], TPC)
    assert model.decide(0, 8, 1_000_000, True).load              # nothing known: load
    model.started(0, JobKind.STORE)                              # one 1 MB cascade: 1 s
    model.finished(0, 1_000_000, 1.0, True, JobKind.STORE)
    decision = model.decide(0, 8, 1_000_000, True)
    assert not decision.load and decision.load_s == pytest.approx(8.0, rel=0.05)
    model.started(0)
    model.finished(0, 1_000_000, 0.001, True)
    assert model.decide(0, 8, 1_000_000, True).load


def test_a_late_poll_does_not_make_a_tier_look_slow():
    """Two 1 MB jobs of 0.1 s each, collected 30 s later (an idle engine polls with its next
    request): the period is bounded by the jobs' own 0.2 s, not the 30 s."""
    link = LinkEstimate(TierCost())
    link.started(0.0)
    link.started(0.0)
    link.finished(1_000_000, 0.1, True, 30.0)
    link.finished(1_000_000, 0.1, True, 30.0)
    assert link.bandwidth_bytes_per_s >= 2_000_000 / 0.2
