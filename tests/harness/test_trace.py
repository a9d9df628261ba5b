"""Trace readers: Mooncake and token-id JSONL, partial blocks, malformed lines."""
from __future__ import annotations

import pytest

from kvhal.integrations.harness import TraceFormatError, read_trace
from kvhal.integrations.harness.trace import chain_hashes

from .conftest import mooncake


def test_mooncake_full_blocks_only_and_chained(write_trace):
    path = write_trace([mooncake([7, 8, 9], input_length=1025), mooncake([7, 8], 1024)])
    first, second = read_trace(path)
    assert (first.line, first.input_tokens, first.output_tokens) == (1, 1025, 1)
    assert len(first.chunk_hashes) == 2  # id 9 covers the 1 token of the partial block
    assert first.chunk_hashes == second.chunk_hashes == chain_hashes([7, 8], 1)
    assert (first.hash_ids, second.hash_ids) == ((7, 8, 9), (7, 8))  # raw ids, partial included


def test_mooncake_same_id_under_different_prefix_is_a_different_chunk(write_trace):
    a, b = read_trace(write_trace([mooncake([1, 2]), mooncake([3, 2])]))
    assert a.chunk_hashes[1] != b.chunk_hashes[1]


def test_empty_and_short_requests_have_no_chunks(write_trace):
    reqs = read_trace(write_trace([mooncake([], 0), mooncake([4], 511), "", mooncake([5], 512)]))
    assert [len(r.chunk_hashes) for r in reqs] == [0, 0, 1]
    assert [r.line for r in reqs] == [1, 2, 4]


def test_token_trace_chunks_by_chunk_tokens(write_trace):
    toks = list(range(10))
    path = write_trace([{"prompt_token_ids": toks, "timestamp": 5},
                        {"prompt_token_ids": toks[:8] + [99]}])
    a, b = read_trace(path, chunk_tokens=4)
    assert (a.timestamp_ms, a.input_tokens, a.output_tokens) == (5.0, 10, 0)
    assert a.chunk_hashes == chain_hashes(toks[:8], 4)
    assert b.chunk_hashes == a.chunk_hashes
    assert a.hash_ids == b.hash_ids == ()


def test_limit_stops_reading_before_later_lines(write_trace):
    path = write_trace([mooncake([1]), mooncake([2]), "not json"])
    assert [r.line for r in read_trace(path, limit=2)] == [1, 2]


@pytest.mark.parametrize("line, field, reason", [
    ("{oops", "json",
     "not valid JSON (Expecting property name enclosed in double quotes at column 2)"),
    ("[1, 2]", "json", "must be a JSON object, got list"),
    ({"input_length": 512, "output_length": 1, "hash_ids": [1]}, "timestamp", "missing"),
    ({"timestamp": 0, "input_length": -1, "output_length": 1, "hash_ids": []}, "input_length",
     "must be a non-negative integer, got -1"),
    ({"timestamp": 0, "input_length": 512, "output_length": "3", "hash_ids": [1]},
     "output_length", "must be a non-negative integer, got '3'"),
    ({"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1]}, "hash_ids",
     "expected 2 ids for input_length 1000 (512 tokens per block), got 1"),
    ({"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [True]}, "hash_ids",
     "element 0 must be an integer, got True"),
    ({"timestamp": "t", "input_length": 512, "output_length": 1, "hash_ids": [1]}, "timestamp",
     "must be a non-negative number, got 't'"),
], ids=lambda p: p if isinstance(p, str) and " " not in p and len(p) < 16 else None)
def test_malformed_line_names_line_and_field(write_trace, line, field, reason):
    path = write_trace([mooncake([1]), mooncake([1, 2]), line, mooncake([3])])
    with pytest.raises(TraceFormatError) as info:
        read_trace(path)
    assert (info.value.line, info.value.field) == (3, field)
    assert str(info.value) == f"{path} line 3: {field}: {reason}"


def test_malformed_token_line(write_trace):
    path = write_trace([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [1, "x"]}])
    with pytest.raises(TraceFormatError) as info:
        read_trace(path)
    assert str(info.value) == f"{path} line 2: prompt_token_ids: element 1 must be an integer, " \
                              "got 'x'"


def test_unknown_format_names_the_expected_field(write_trace):
    path = write_trace([{"prompt": "hello"}])
    with pytest.raises(TraceFormatError) as info:
        read_trace(path)
    assert str(info.value) == f"{path} line 1: hash_ids: missing (neither a Mooncake line with " \
                              "hash_ids nor a token-id line with prompt_token_ids)"


def test_non_utf8_line_names_line_and_byte(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\n\xff\xfe\n")
    with pytest.raises(TraceFormatError) as info:
        read_trace(path)
    assert str(info.value) == f"{path} line 2: json: not UTF-8 text (byte 0)"
