"""Trace readers: Mooncake JSONL and plain token-id JSONL → `TraceRequest`s.

Formats (one JSON object per line; blank lines are skipped):

- **Mooncake** (kvcache-ai/Mooncake `FAST25-release/traces/`, Apache-2.0): `timestamp` (ms since
  the trace start), `input_length` and `output_length` (tokens), `hash_ids` (remapped prefix
  block hashes, one per 512-token block: equal ids = reusable prefix). The last id covers a
  partial block when `input_length` is not a multiple of 512, so a request has
  `ceil(input_length / 512)` ids of which the first `input_length // 512` name full blocks.
- **Token ids**: `{"prompt_token_ids": [int, ...]}` with optional `timestamp` (ms) and
  `output_length` (tokens, default 0). Chunks are `chunk_tokens` consecutive token ids.

Each full chunk of a request is named by vLLM's block-hash chain (`kvhal.keys.block_hashes`,
sha256, seed `HASH_SEED`) over the chunk's contents — its token ids, or for Mooncake its one
hash id — so equal hashes mean equal prefixes, exactly as a serving engine keys its KV. Only full
chunks are named: a partial last chunk is never stored nor hit.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Iterator

from kvhal.keys import block_hashes, hash_function, none_hash

#: Tokens per block in Mooncake traces (fixed by the format, see module docstring).
MOONCAKE_BLOCK_TOKENS = 512

FORMATS = ("auto", "mooncake", "tokens")

#: Block-hash function and NONE_HASH seed of replay keys (fixed, so a persistent tier written by
#: one replay is hit by the next).
HASH_NAME = "sha256"
HASH_SEED = "kvhal-replay"
_HASH_FN = hash_function(HASH_NAME)
_ROOT = none_hash(HASH_NAME, HASH_SEED)


class TraceFormatError(ValueError):
    """A trace line is malformed. `line` is 1-based; `field` names the offending JSON field
    ("json" when the line is not a JSON object)."""

    def __init__(self, path: str, line: int, field: str, reason: str):
        super().__init__(f"{path} line {line}: {field}: {reason}")
        self.path = path
        self.line = line
        self.field = field


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        line: 1-based line number in the trace file.
        timestamp_ms: Arrival time in milliseconds since the trace start.
        input_tokens: Prompt length in tokens.
        output_tokens: Generated tokens (not replayed; reported only).
        chunk_hashes: One block hash per *full* chunk of the prompt, in prompt order, each
            chained over all earlier chunks (bytes; equal hash ⇔ equal prefix).
        hash_ids: The line's raw Mooncake `hash_ids`, `ceil(input_tokens / 512)` of them,
            partial last block included (empty for token-id lines).
    """

    line: int
    timestamp_ms: float
    input_tokens: int
    output_tokens: int
    chunk_hashes: tuple[bytes, ...]
    hash_ids: tuple[int, ...] = ()


def chain_hashes(ids: list[int], ids_per_chunk: int) -> tuple[bytes, ...]:
    """Block hashes of every full chunk of `ids_per_chunk` consecutive `ids` (see module
    docstring); a partial last chunk gets none."""
    return tuple(block_hashes(ids, ids_per_chunk, _HASH_FN, root=_ROOT))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(obj: dict, name: str, err, *, default: Any = None, integer: bool) -> Any:
    if name not in obj:
        if default is None:
            raise err(name, "missing")
        return default
    v = obj[name]
    ok = _is_int(v) if integer else (_is_int(v) or isinstance(v, float))
    if not ok or v < 0:
        kind = "a non-negative integer" if integer else "a non-negative number"
        raise err(name, f"must be {kind}, got {v!r}")
    return v


def _int_list(obj: dict, name: str, err) -> list[int]:
    if name not in obj:
        raise err(name, "missing")
    v = obj[name]
    if not isinstance(v, list):
        raise err(name, f"must be a list of integers, got {type(v).__name__}")
    for i, x in enumerate(v):
        if not _is_int(x):
            raise err(name, f"element {i} must be an integer, got {x!r}")
    return v


def _parse_mooncake(obj: dict, line: int, err) -> TraceRequest:
    ts = _number(obj, "timestamp", err, integer=False)
    n_in = _number(obj, "input_length", err, integer=True)
    n_out = _number(obj, "output_length", err, integer=True)
    ids = _int_list(obj, "hash_ids", err)
    expected = -(-n_in // MOONCAKE_BLOCK_TOKENS)
    if len(ids) != expected:
        raise err("hash_ids", f"expected {expected} ids for input_length {n_in} "
                              f"({MOONCAKE_BLOCK_TOKENS} tokens per block), got {len(ids)}")
    full = n_in // MOONCAKE_BLOCK_TOKENS
    return TraceRequest(line, float(ts), n_in, n_out, chain_hashes(ids[:full], 1), tuple(ids))


def _parse_tokens(obj: dict, line: int, err, chunk_tokens: int) -> TraceRequest:
    tokens = _int_list(obj, "prompt_token_ids", err)
    ts = _number(obj, "timestamp", err, default=0.0, integer=False)
    n_out = _number(obj, "output_length", err, default=0, integer=True)
    return TraceRequest(line, float(ts), len(tokens), n_out, chain_hashes(tokens, chunk_tokens))


def _detect(obj: dict) -> str | None:
    if "hash_ids" in obj:
        return "mooncake"
    if "prompt_token_ids" in obj:
        return "tokens"
    return None


def iter_trace(path: str | os.PathLike, *, fmt: str = "auto", chunk_tokens: int =
               MOONCAKE_BLOCK_TOKENS, limit: int | None = None) -> Iterator[TraceRequest]:
    """Yield the requests of a JSONL trace in file order.

    Args:
        path: The trace file.
        fmt: "mooncake", "tokens", or "auto" (decided by the first non-blank line: `hash_ids`
            → mooncake, `prompt_token_ids` → tokens).
        chunk_tokens: Tokens per chunk for token-id traces (Mooncake's is fixed at 512).
        limit: Stop after this many requests (None = all).

    Raises:
        TraceFormatError: a line is not a JSON object, a field is missing or has the wrong type
            or value; the message names the file, the 1-based line and the field. Requests
            before the bad line have already been yielded.
        OSError: the file cannot be read.
        ValueError: `fmt`, `chunk_tokens` or `limit` is invalid.
    """
    if fmt not in FORMATS:
        raise ValueError(f"trace format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be non-negative, got {limit}")
    name = os.fspath(path)
    count = 0
    with open(path, "rb") as f:  # bytes: a non-UTF-8 line is a TraceFormatError naming it
        for lineno, text in enumerate(f, start=1):
            if limit is not None and count >= limit:
                return
            if not text.strip():
                continue

            def err(field: str, reason: str, _line: int = lineno) -> TraceFormatError:
                return TraceFormatError(name, _line, field, reason)

            try:
                obj = json.loads(text.decode("utf-8"))
            except json.JSONDecodeError as exc:
                raise err("json", f"not valid JSON ({exc.msg} at column {exc.colno})") from None
            except UnicodeDecodeError as exc:
                raise err("json", f"not UTF-8 text (byte {exc.start})") from None
            if not isinstance(obj, dict):
                raise err("json", f"must be a JSON object, got {type(obj).__name__}")
            if fmt == "auto":
                fmt = _detect(obj) or "auto"
                if fmt == "auto":
                    raise err("hash_ids", "missing (neither a Mooncake line with hash_ids nor a "
                                          "token-id line with prompt_token_ids)")
            if fmt == "mooncake":
                yield _parse_mooncake(obj, lineno, err)
            else:
                yield _parse_tokens(obj, lineno, err, chunk_tokens)
            count += 1


def read_trace(path: str | os.PathLike, **kwargs: Any) -> list[TraceRequest]:
    """All requests of a trace (see `iter_trace` for arguments and errors); the whole file is
    validated before anything is returned, so a malformed line fails the run up front."""
    return list(iter_trace(path, **kwargs))
