"""Host slot pools of hybrid models: one slot size per KV cache group, exact bytes, eviction
within a group, and the per-group lookup rule (`needed_chunks`)."""
from __future__ import annotations

import pytest

from kvhal.engine import needed_chunks
from kvhal.host import HostRegionError, LRUPolicy, SlotTable, host_layout
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
