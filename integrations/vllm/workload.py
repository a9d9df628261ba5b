"""Multi-turn conversation workloads shaped by the Mooncake conversation trace.

Source format (kvcache-ai/Mooncake `FAST25-release/traces/conversation_trace.jsonl`, Apache-2.0):
one JSON object per request with `timestamp` (ms), `input_length` and `output_length` (tokens)
and `hash_ids` (remapped hashes of the prompt's 512-token prefix blocks; equal ids = equal
tokens). Every request starts with the shared block 0 (a system prompt); requests of one
conversation share their first two ids and each turn extends the previous turn's prefix.

`demo_slice.jsonl` next to this module holds the conversations the demo uses, cut from that trace
by `select_conversations` (so a fresh clone needs no copy of the full trace).
"""
from __future__ import annotations

import json
import random
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

#: Tokens per hash id in the Mooncake trace (its README: "block size 512").
TRACE_BLOCK_TOKENS = 512
#: The slice shipped with the package.
DEMO_SLICE = Path(__file__).with_name("demo_slice.jsonl")


class TraceError(ValueError):
    """A trace line is malformed; the message names the line number and the field."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of the trace (lengths in tokens, timestamp in milliseconds)."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Turn:
    """One request the demo sends.

    Attributes:
        conversation: Index of its conversation (0-based, in first-arrival order).
        turn: Index of the turn within its conversation (0-based).
        prompt: Token ids of the prompt (ints in [3, vocab_size)).
        max_tokens: Output tokens to generate.
    """

    conversation: int
    turn: int
    prompt: tuple[int, ...]
    max_tokens: int


def read_trace(path: Path) -> list[TraceRequest]:
    """Parse a Mooncake-format JSONL trace.

    Raises:
        TraceError: a line is not JSON or lacks/mistypes a field (line number named).
        OSError: the file cannot be read.
    """
    out: list[TraceRequest] = []
    with open(path, "rb") as f:  # bytes: a non-UTF-8 line is a TraceError naming it
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line.decode("utf-8"))
                out.append(TraceRequest(int(row["timestamp"]), int(row["input_length"]),
                                        int(row["output_length"]),
                                        tuple(int(h) for h in row["hash_ids"])))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise TraceError(f"{path}:{lineno}: bad trace line ({exc!r})") from None
    return out


def select_conversations(trace: Sequence[TraceRequest], num_conversations: int,
                         turns_per_conversation: int) -> list[list[TraceRequest]]:
    """The first `num_conversations` conversations with at least `turns_per_conversation`
    turns, each cut to that many turns, in order of first arrival.

    A conversation is the requests sharing their first two hash ids (block 0 is common to all).

    Raises:
        TraceError: the trace has fewer such conversations.
    """
    groups: dict[tuple[int, ...], list[TraceRequest]] = defaultdict(list)
    for req in trace:
        if len(req.hash_ids) >= 2:
            groups[req.hash_ids[:2]].append(req)
    chosen = [g[:turns_per_conversation] for g in groups.values()
              if len(g) >= turns_per_conversation][:num_conversations]
    if len(chosen) < num_conversations:
        raise TraceError(f"trace has {len(chosen)} conversations with ≥ "
                         f"{turns_per_conversation} turns, {num_conversations} needed")
    return chosen


def build_turns(conversations: Sequence[Sequence[TraceRequest]], *, max_input_tokens: int,
                max_output_tokens: int, vocab_size: int, seed: int = 0) -> list[Turn]:
    """Turn trace conversations into token-id prompts, in arrival (timestamp) order.

    Lengths are scaled by one factor so the longest input is `max_input_tokens`; each hash id
    becomes `round(512 * factor)` fixed random tokens (seeded by `seed` and the id), so equal
    ids give equal tokens and the trace's shared-prefix structure is kept exactly. Output
    lengths are scaled the same way and capped at `max_output_tokens` (≥ 1).

    Raises:
        ValueError: max_input_tokens < 1, max_output_tokens < 1 or vocab_size ≤ 3.
    """
    if max_input_tokens < 1 or max_output_tokens < 1 or vocab_size <= 3:
        raise ValueError(f"need max_input_tokens ≥ 1, max_output_tokens ≥ 1, vocab_size > 3; "
                         f"got {max_input_tokens}, {max_output_tokens}, {vocab_size}")
    longest = max(r.input_length for conv in conversations for r in conv)
    factor = max_input_tokens / longest
    block_tokens = max(1, round(TRACE_BLOCK_TOKENS * factor))
    cache: dict[int, list[int]] = {}

    def block(hash_id: int) -> list[int]:
        if hash_id not in cache:
            rnd = random.Random(seed * 1_000_003 + hash_id)
            cache[hash_id] = [rnd.randrange(3, vocab_size) for _ in range(block_tokens)]
        return cache[hash_id]

    events = []
    for c, conv in enumerate(conversations):
        for t, req in enumerate(conv):
            n = max(1, round(req.input_length * factor))
            tokens = [tok for h in req.hash_ids for tok in block(h)][:n]
            out = max(1, min(max_output_tokens, round(req.output_length * factor)))
            events.append((req.timestamp_ms, c, t, Turn(c, t, tuple(tokens), out)))
    return [turn for *_, turn in sorted(events, key=lambda e: e[:3])]


def write_slice(conversations: Iterable[Sequence[TraceRequest]], path: Path) -> None:
    """Write conversations back as Mooncake-format JSONL (for shipping a small slice)."""
    with open(path, "w") as f:
        for conv in conversations:
            for r in conv:
                f.write(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                    "output_length": r.output_length,
                                    "hash_ids": list(r.hash_ids)}) + "\n")
