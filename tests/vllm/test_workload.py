"""The demo's workload: Mooncake-trace conversations turned into token-id prompts."""
from __future__ import annotations

import json

import pytest

from kvhal.integrations.vllm.workload import (DEMO_SLICE, TraceError, TraceRequest, build_turns,
                                              read_trace, select_conversations)


def test_shipped_slice_has_eight_six_turn_conversations():
    convs = select_conversations(read_trace(DEMO_SLICE), 8, 6)
    assert [len(c) for c in convs] == [6] * 8
    assert all(req.hash_ids[0] == 0 for conv in convs for req in conv)


def test_turns_keep_the_trace_prefix_structure_exactly():
    conv = [TraceRequest(0, 1024, 10, (0, 7)), TraceRequest(5, 1536, 10, (0, 7, 9)),
            TraceRequest(9, 1536, 10, (0, 7, 8))]
    turns = build_turns([conv], max_input_tokens=768, max_output_tokens=4, vocab_size=50)
    first, second, third = (t.prompt for t in turns)
    assert (len(first), len(second), len(third)) == (512, 768, 768)
    assert second[:512] == first            # hash ids (0, 7) shared
    assert third[:512] == first and third[512:] != second[512:]   # 9 vs 8 differ
    assert [t.max_tokens for t in turns] == [4, 4, 4]
    assert all(3 <= tok < 50 for t in turns for tok in t.prompt)


def test_turns_are_in_arrival_order_across_conversations():
    a = [TraceRequest(0, 512, 1, (0, 1)), TraceRequest(20, 512, 1, (0, 1))]
    b = [TraceRequest(10, 512, 1, (0, 2))]
    turns = build_turns([a, b], max_input_tokens=512, max_output_tokens=1, vocab_size=10)
    assert [(t.conversation, t.turn) for t in turns] == [(0, 0), (1, 0), (0, 1)]


def test_bad_trace_line_names_the_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1,
                                "hash_ids": [0]}) + "\n{\"timestamp\": 1}\n")
    with pytest.raises(TraceError, match=r"t.jsonl:2: bad trace line"):
        read_trace(path)



def test_non_utf8_trace_line_names_the_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\n\xff\xfe\n")
    with pytest.raises(TraceError, match=r"t.jsonl:2: bad trace line \(UnicodeDecodeError"):
        read_trace(path)


def test_too_few_conversations_is_refused():
    with pytest.raises(TraceError, match="trace has 8 conversations with ≥ 6 turns, 9 needed"):
        select_conversations(read_trace(DEMO_SLICE), 9, 6)
