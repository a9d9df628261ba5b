"""Per-request arithmetic an integration needs: which chunks to store, how many tokens hit."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvhal.layout import Kind
from kvhal.tier import Lookup


def chunks_to_store(num_computed_tokens: int, num_stored_chunks: int, tokens_per_chunk: int,
                    max_offload_tokens: int | None = None) -> range:
    """Chunk indices a request should store now, so its stored chunks stay a contiguous prefix
    under any (chunked-)prefill schedule.

    Only full chunks are stored: a request with `num_computed_tokens` computed tokens has
    `num_computed_tokens // tokens_per_chunk` full chunks; a partial last chunk waits for more
    tokens. `max_offload_tokens` caps the stored tokens (0 stores nothing; None: no cap).

    Args:
        num_computed_tokens: Tokens whose KV is computed (or scheduled to be by this step).
        num_stored_chunks: Chunks already handed to `prepare_store` for this request.
        tokens_per_chunk: Tokens per chunk (block_size * blocks_per_chunk).
        max_offload_tokens: Per-request cap in tokens, or None.

    Returns:
        range(num_stored_chunks, end): empty if nothing new is due.
    """
    end = num_computed_tokens // tokens_per_chunk
    if max_offload_tokens is not None:
        end = min(end, max_offload_tokens // tokens_per_chunk)
    return range(num_stored_chunks, max(end, num_stored_chunks))


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """How far a prefix hits, read from `Manager.lookup`'s answers for its chunks in order.

    Attributes:
        num_chunks: Chunks before the first MISS: in host memory now (HIT), on their way into
            it (RETRY), or not known yet (UNDECIDED).
        num_ready: Leading HITs: the chunks loadable now (at most `num_chunks`).
        pending: A RETRY is among the first `num_chunks`.
        undecided: An UNDECIDED is among the first `num_chunks`.
    """

    num_chunks: int
    num_ready: int
    pending: bool
    undecided: bool


def prefix_hit(answers: Sequence[Lookup]) -> PrefixHit:
    """How many chunks of a prefix hit, given `Manager.lookup`'s answers (the one place that
    reads them so; `leading_hits` is its short form)."""
    num_chunks = next((i for i, a in enumerate(answers) if a is Lookup.MISS), len(answers))
    head = answers[:num_chunks]
    num_ready = next((i for i, a in enumerate(head) if a is not Lookup.HIT), num_chunks)
    return PrefixHit(num_chunks, num_ready, Lookup.RETRY in head, Lookup.UNDECIDED in head)


def leading_hits(answers: Sequence[Lookup]) -> int | None:
    """Chunks loadable now from the start of a prefix, given `Manager.lookup`'s answers.

    Returns:
        The number of leading HITs, or None if a RETRY or UNDECIDED comes before the first
        MISS (a chunk is on its way into host memory, or a tier cannot tell yet whether it
        holds it: ask again on a later step).
    """
    hit = prefix_hit(answers)
    return hit.num_chunks if hit.num_ready == hit.num_chunks else None


def needed_chunks(kind: Kind, start: int, end: int, tokens_per_chunk: int, block_size: int,
                  sliding_window: int | None = None) -> range:
    """Chunks of one KV cache group a hit of chunks `[start, end)` must load, so that the
    engine can compute token `end * tokens_per_chunk` next.

    Full attention and MLA read the whole prefix: every chunk. A sliding-window group reads
    only the last `sliding_window` tokens: the engine keeps (and allocates for a hit) the
    blocks from `(L - sliding_window + 1) // block_size` on, L = end * tokens_per_chunk (vLLM
    `SlidingWindowManager.get_num_skipped_tokens`, 0.32); earlier ones are null blocks. A
    state group (Mamba) needs only the state at the hit's last chunk boundary.

    Args:
        kind: The group's `kvhal.layout.Kind`.
        start, end: The hit's chunk range (`start` < `end` for a hit; empty otherwise).
        tokens_per_chunk, block_size: Tokens per chunk and per engine block.
        sliding_window: The window in tokens (sliding-window groups).

    Returns:
        A sub-range of `range(start, end)`, empty when `end <= start`.
    """
    if end <= start:
        return range(start, start)
    if kind is Kind.SLIDING_WINDOW:
        skipped = max(0, end * tokens_per_chunk - sliding_window + 1)
        first_block = skipped // block_size
        return range(max(start, first_block * block_size // tokens_per_chunk), end)
    if kind is Kind.MAMBA:
        return range(end - 1, end)
    return range(start, end)
