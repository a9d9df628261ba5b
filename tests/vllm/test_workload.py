"""The demo's workload: Mooncake-trace conversations turned into token-id prompts."""
from __future__ import annotations

import subprocess
import sys

import pytest

from kvhal.integrations.harness.trace import TraceFormatError, TraceRequest, read_trace
from kvhal.integrations.harness.vllm.workload import (DEMO_SLICE, build_turns, select_conversations,
                                              write_slice)


def request(ts: float, input_tokens: int, hash_ids: tuple[int, ...]) -> TraceRequest:
    """A Mooncake request with 10 output tokens (chunk hashes do not matter to the workload)."""
    return TraceRequest(line=1, timestamp_ms=ts, input_tokens=input_tokens, output_tokens=10,
                        chunk_hashes=(), hash_ids=hash_ids)


def test_shipped_slice_has_eight_six_turn_conversations():
    convs = select_conversations(read_trace(DEMO_SLICE), 8, 6)
    assert [len(c) for c in convs] == [6] * 8
    assert all(req.hash_ids[0] == 0 for conv in convs for req in conv)


def test_write_slice_reproduces_the_shipped_slice(tmp_path):
    convs = select_conversations(read_trace(DEMO_SLICE), 8, 6)
    write_slice(convs, tmp_path / "slice.jsonl")
    assert (tmp_path / "slice.jsonl").read_bytes() == DEMO_SLICE.read_bytes()


def test_turns_keep_the_trace_prefix_structure_exactly():
    conv = [request(0, 1024, (0, 7)), request(5, 1536, (0, 7, 9)), request(9, 1536, (0, 7, 8))]
    turns = build_turns([conv], max_input_tokens=768, max_output_tokens=4, vocab_size=50)
    first, second, third = (t.prompt for t in turns)
    assert (len(first), len(second), len(third)) == (512, 768, 768)
    assert second[:512] == first            # hash ids (0, 7) shared
    assert third[:512] == first and third[512:] != second[512:]   # 9 vs 8 differ
    assert [t.max_tokens for t in turns] == [4, 4, 4]
    assert all(3 <= tok < 50 for t in turns for tok in t.prompt)


def test_turns_are_in_arrival_order_across_conversations():
    a = [request(0, 512, (0, 1)), request(20, 512, (0, 1))]
    b = [request(10, 512, (0, 2))]
    turns = build_turns([a, b], max_input_tokens=512, max_output_tokens=1, vocab_size=10)
    assert [(t.conversation, t.turn) for t in turns] == [(0, 0), (1, 0), (0, 1)]


def test_too_few_conversations_is_refused():
    with pytest.raises(ValueError) as info:
        select_conversations(read_trace(DEMO_SLICE), 9, 6)
    assert str(info.value) == "trace has 8 conversations with ≥ 6 turns, 9 needed"


def test_token_id_trace_has_no_conversations(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt_token_ids": [1, 2, 3]}\n')
    with pytest.raises(ValueError) as info:
        select_conversations(read_trace(path), 1, 1)
    assert str(info.value) == "trace has 0 conversations with ≥ 1 turns, 1 needed"


@pytest.mark.parametrize("line, message", [
    ('{"timestamp": 1}', "line 2: input_length: missing"),
    ('{"timestamp": 1, "input_length": 1024, "output_length": 1, "hash_ids": [0]}',
     "line 2: hash_ids: expected 2 ids for input_length 1024 (512 tokens per block), got 1"),
])
def test_demo_bad_trace_is_one_line_naming_file_line_and_field(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n'
                    + line + "\n")
    with pytest.raises(TraceFormatError):
        read_trace(path, fmt="mooncake")
    out = subprocess.run([sys.executable, "-m", "kvhal.cli", "demo", "--trace", str(path),
                          "--workdir", str(tmp_path / "demo")], capture_output=True, text=True,
                         timeout=120)
    assert (out.returncode, out.stderr) == (1, f"kvhal demo: error: {path} {message}\n")
