"""Host slot pools of hybrid models: one slot size per KV cache group, exact bytes, eviction
within a group, and the per-group lookup rule (`needed_chunks`)."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, strategies as st

from kvhal.engine import needed_chunks
from kvhal.host import PAGE_BYTES, HostRegionError, LRUPolicy, SlotTable, host_layout
from kvhal.layout import Kind


def test_layout_gives_each_group_its_own_slot_size_and_the_same_slot_count():
    layout = host_layout((5000, 131072), 10 * (8192 + 131072) + 100)
    assert [(p.slot_bytes, p.chunk_nbytes, p.capacity) for p in layout.pools] == [
        (8192, 5000, 10), (131072, 131072, 10)]
    assert layout.offsets == (0, 81920) and layout.nbytes == 10 * (8192 + 131072)
    assert layout.first_slots == (0, 10)
    assert layout.slot_span(0) == (0, 5000)
    assert layout.slot_span(12) == (81920 + 2 * 131072, 131072)
    with pytest.raises(IndexError):
        layout.slot_span(20)


def test_layout_refuses_a_budget_without_one_slot_per_group():
    with pytest.raises(HostRegionError, match="holds no slot of every group"):
        host_layout((4096, 4096), 8191)
    with pytest.raises(HostRegionError, match="cpu_bytes_to_use=204799 holds no slot"):
        host_layout((131072, 71680), 204799, (1.0, 1e-9))


# attention chunks of 131072 bytes, states of 71680 (slots of 73728), a state share of 1/4
ATTN, STATE = 131072, 73728
FIT = 100 * ATTN + 25 * STATE


@pytest.mark.parametrize("budget, counts", [
    (FIT, (100, 25)),
    (FIT + ATTN - 1, (100, 25)),           # 101 attention slots do not fit: left over
    (FIT + ATTN, (101, 25)),
    (FIT + 4 * ATTN + STATE, (104, 26)),
    (ATTN + STATE, (1, 1)),                 # every pool keeps one slot
], ids=lambda v: str(v))
def test_slot_counts_follow_the_shares(budget, counts):
    layout = host_layout((131072, 71680), budget, (1.0, 0.25))
    assert layout.capacities == counts
    assert [p.slot_bytes for p in layout.pools] == [ATTN, STATE]
    assert layout.offsets == (0, counts[0] * ATTN)
    assert layout.nbytes == counts[0] * ATTN + counts[1] * STATE <= budget


def test_shares_are_taken_as_decimal_fractions():
    # 0.3 as a float is just below 3/10: 10 slots of share 1 still give 3 of share 0.3.
    assert host_layout((4096, 4096), 13 * 4096, (1.0, 0.3)).capacities == (10, 3)
    # shares are relative to the largest
    assert host_layout((4096, 4096), 13 * 4096, (0.5, 0.15)).capacities == (10, 3)


def test_a_tiny_share_keeps_one_slot():
    assert host_layout((4096, 4096), 100 * 4096, (1.0, 1e-6)).capacities == (99, 1)


@pytest.mark.parametrize("shares, message", [
    ((1.0, 0), "shares[1]: must be a finite number > 0, got 0"),
    ((-1, 1.0), "shares[0]: must be a finite number > 0, got -1"),
    ((1.0, math.nan), "shares[1]: must be a finite number > 0, got nan"),
    ((1.0, math.inf), "shares[1]: must be a finite number > 0, got inf"),
    ((1.0, True), "shares[1]: must be a finite number > 0, got True"),
    ((1.0, "0.5"), "shares[1]: must be a finite number > 0, got '0.5'"),
    ((1.0,), "shares: 1 given for 2 groups"),
], ids=lambda v: str(v))
def test_bad_shares_are_named(shares, message):
    with pytest.raises(HostRegionError) as err:
        host_layout((4096, 4096), 1 << 20, shares)
    assert str(err.value) == message


@given(st.lists(st.tuples(st.integers(1, 1 << 20), st.floats(1e-3, 1.0)), min_size=1,
                max_size=4),
       st.integers(1, 1 << 28))
def test_pools_fill_the_budget_exactly_as_far_as_whole_slots_allow(groups, budget):
    chunks = tuple(n for n, _ in groups)
    shares = tuple(s for _, s in groups)
    slots = [-(-n // PAGE_BYTES) * PAGE_BYTES for n in chunks]
    if sum(slots) > budget:
        with pytest.raises(HostRegionError):
            host_layout(chunks, budget, shares)
        return
    layout = host_layout(chunks, budget, shares)
    # each slot is its own chunk rounded to the page, never another group's size
    assert [(p.chunk_nbytes, p.slot_bytes) for p in layout.pools] == list(zip(chunks, slots))
    assert layout.nbytes == sum(c * s for c, s in zip(layout.capacities, slots)) <= budget
    assert min(layout.capacities) >= 1
    top = max(layout.capacities)
    # counts follow the shares as far as whole slots allow; less than one slot of every pool
    # is left over
    assert all(abs(c - max(1, top * s / max(shares))) < 1
               for c, s in zip(layout.capacities, shares))
    assert budget - layout.nbytes < sum(slots)


def test_eviction_stays_inside_the_key_pool():
    table = SlotTable((2, 1), [LRUPolicy(2), LRUPolicy(1)], pool_of=lambda k: k[0])
    slots, _ = table.reserve([(0, "a"), (0, "b"), (1, "x")])
    assert slots == [0, 1, 2]
    for s in slots:
        table.commit(s)
    slots, evicted = table.reserve([(1, "y")])
    assert evicted == [(1, "x")] and slots == [2]       # pool 0's older chunks stay
    assert table.num_free_in(0) == 0 and (0, "a") in table.index


@pytest.mark.parametrize("kind, start, end, want", [
    (Kind.FULL, 2, 7, range(2, 7)),
    (Kind.MLA, 0, 7, range(0, 7)),
    # window 256 at token 896: vLLM keeps blocks from (896 - 255) // 128 = 5 on.
    (Kind.SLIDING_WINDOW, 0, 7, range(5, 7)),
    (Kind.SLIDING_WINDOW, 6, 7, range(6, 7)),
    (Kind.SLIDING_WINDOW, 0, 1, range(0, 1)),
    (Kind.MAMBA, 0, 7, range(6, 7)),
    (Kind.FULL, 3, 3, range(3, 3)),
], ids=lambda p: str(p))
def test_needed_chunks_per_kind(kind, start, end, want):
    assert needed_chunks(kind, start, end, 128, 128, 256) == want


def test_manager_reports_host_bytes_as_the_slot_bytes_of_each_pool():
    import dataclasses

    from kvhal.config import parse_config
    from kvhal.engine import build_manager

    from .rig import synthetic_keys

    layout = host_layout((131072, 71680), 4 * ATTN + 2 * STATE, (1.0, 0.5))
    assert layout.capacities == (4, 2)
    manager = build_manager(parse_config({"cpu_bytes_to_use": layout.nbytes}), layout,
                            memoryview(bytearray(layout.nbytes)), bytes(16), emit_events=False)
    attn = synthetic_keys(3)
    state = [dataclasses.replace(k, group=1) for k in synthetic_keys(1, tag=1)]
    plan = manager.prepare_store(attn + state)
    manager.complete_store(plan.job_id)
    # 3 attention slots of 131072 bytes and 1 state slot of 73728 (71680 rounded to the page)
    assert manager.sizes()["host"] == (3 * ATTN + STATE, 4 * ATTN + 2 * STATE)
