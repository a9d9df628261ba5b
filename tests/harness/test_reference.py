"""The reference computation: unlimited capacity, longest prefix of stored full chunks."""
from __future__ import annotations

from kvhal.integrations.harness import read_trace, reference_hits

from .conftest import mooncake


def test_hand_made_trace_exact_hits(write_trace):
    path = write_trace([
        mooncake([1, 2, 3]),            # 0 hit, stores 1,2,3
        mooncake([1, 2, 4]),            # hits 1,2 → 1024
        mooncake([1, 2, 3, 5], 1600),   # hits 1,2,3 (5 is partial) → 1536
        mooncake([1, 2, 3, 5], 2048),   # 5 was never stored as full → 1536
        mooncake([9, 2, 3]),            # different first block: no hit
        mooncake([], 0),                # empty request
        mooncake([1, 2, 3, 5], 2048),   # now 5 is stored → 2048
    ])
    ref = reference_hits(read_trace(path), 512)
    assert (ref.requests, ref.input_tokens) == (7, 1536 * 3 + 1600 + 2048 * 2)
    assert ref.hit_tokens == 1024 + 1536 + 1536 + 2048
    assert ref.distinct_chunks == 8  # 1,2,3 | 4 | 5 | 9,2',3'


def test_conversation_trace_reference_value(conversation_trace):
    ref = reference_hits(read_trace(conversation_trace), 512)
    assert (ref.requests, ref.input_tokens, ref.hit_tokens, ref.distinct_chunks) == (
        12031, 144_793_823, 54_063_104, 170_899)
    assert round(ref.hit_ratio, 4) == 0.3734
