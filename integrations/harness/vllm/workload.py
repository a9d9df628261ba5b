"""Multi-turn conversation workloads shaped by the Mooncake conversation trace.

Source: kvcache-ai/Mooncake `FAST25-release/traces/conversation_trace.jsonl` (Apache-2.0), read
by the one trace parser, `kvhal.integrations.harness.trace` (its docstring describes the format).
Every request starts with the shared block 0 (a system prompt); requests of one conversation
share their first two hash ids and each turn extends the previous turn's prefix.

`demo_slice.jsonl` next to this module holds the conversations the demo uses, cut from that trace
by `select_conversations` and written by `write_slice` (so a fresh clone needs no copy of the
full trace).
"""
from __future__ import annotations

import json
import random
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from kvhal.integrations.harness.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest

#: The slice shipped with the package.
DEMO_SLICE = Path(__file__).with_name("demo_slice.jsonl")


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


def select_conversations(trace: Sequence[TraceRequest], num_conversations: int,
                         turns_per_conversation: int) -> list[list[TraceRequest]]:
    """The first `num_conversations` conversations with at least `turns_per_conversation`
    turns, each cut to that many turns, in order of first arrival.

    A conversation is the requests sharing their first two Mooncake hash ids (block 0 is
    common to all); requests with fewer ids (token-id lines have none) belong to none.

    Raises:
        ValueError: the trace has fewer such conversations.
    """
    groups: dict[tuple[int, ...], list[TraceRequest]] = defaultdict(list)
    for req in trace:
        if len(req.hash_ids) >= 2:
            groups[req.hash_ids[:2]].append(req)
    chosen = [g[:turns_per_conversation] for g in groups.values()
              if len(g) >= turns_per_conversation][:num_conversations]
    if len(chosen) < num_conversations:
        raise ValueError(f"trace has {len(chosen)} conversations with ≥ "
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
    longest = max(r.input_tokens for conv in conversations for r in conv)
    factor = max_input_tokens / longest
    block_tokens = max(1, round(MOONCAKE_BLOCK_TOKENS * factor))
    cache: dict[int, list[int]] = {}

    def block(hash_id: int) -> list[int]:
        if hash_id not in cache:
            rnd = random.Random(seed * 1_000_003 + hash_id)
            cache[hash_id] = [rnd.randrange(3, vocab_size) for _ in range(block_tokens)]
        return cache[hash_id]

    events = []
    for c, conv in enumerate(conversations):
        for t, req in enumerate(conv):
            n = max(1, round(req.input_tokens * factor))
            tokens = [tok for h in req.hash_ids for tok in block(h)][:n]
            out = max(1, min(max_output_tokens, round(req.output_tokens * factor)))
            events.append((req.timestamp_ms, c, t, Turn(c, t, tuple(tokens), out)))
    return [turn for *_, turn in sorted(events, key=lambda e: e[:3])]


def write_slice(conversations: Iterable[Sequence[TraceRequest]], path: Path) -> None:
    """Write requests read from a Mooncake trace back as Mooncake-format JSONL (for shipping a
    small slice); `read_trace` gives them back with equal fields, line numbers aside.

    Raises:
        OSError: the file cannot be written.
    """
    with open(path, "w") as f:
        for conv in conversations:
            for r in conv:
                ts = int(r.timestamp_ms) if r.timestamp_ms.is_integer() else r.timestamp_ms
                f.write(json.dumps({"timestamp": ts, "input_length": r.input_tokens,
                                    "output_length": r.output_tokens,
                                    "hash_ids": list(r.hash_ids)}) + "\n")
