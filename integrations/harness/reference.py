"""The reference hit count: unlimited capacity, only full chunks stored.

A request's hit is the longest prefix of its full chunks that earlier requests stored; then all
its full chunks are stored. This is the upper bound any finite tiering can reach, and what a
replay with capacity for every chunk must report exactly. On Mooncake's conversation trace it is
54,063,104 hit tokens of 144,793,823 input tokens (170,899 distinct full chunks).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from .trace import TraceRequest


@dataclass(frozen=True, slots=True)
class ReferenceResult:
    """Totals of the reference computation (tokens; chunks = distinct full chunks stored)."""

    requests: int
    input_tokens: int
    hit_tokens: int
    distinct_chunks: int

    @property
    def hit_ratio(self) -> float:
        """hit_tokens / input_tokens (0.0 for an empty trace)."""
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0


def reference_hits(requests: Iterable[TraceRequest], chunk_tokens: int) -> ReferenceResult:
    """Replay `requests` against an unlimited store of full chunks.

    Args:
        requests: Trace requests in replay order.
        chunk_tokens: Tokens per chunk (512 for Mooncake traces).

    Returns:
        The totals; `hit_tokens` is a multiple of `chunk_tokens`.
    """
    stored: set[bytes] = set()
    n = input_tokens = hit_chunks = 0
    for req in requests:
        n += 1
        input_tokens += req.input_tokens
        hashes = req.chunk_hashes
        k = 0
        while k < len(hashes) and hashes[k] in stored:
            k += 1
        hit_chunks += k
        stored.update(hashes[k:])
    return ReferenceResult(n, input_tokens, hit_chunks * chunk_tokens, len(stored))
