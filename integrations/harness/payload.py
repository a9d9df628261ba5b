"""Deterministic chunk payloads, so every load can be verified byte for byte.

A chunk's bytes are a function of its key alone: 64-bit word i of page p (one page per layer) is
`(i * G) XOR seed XOR ((p + 1) * P)` with `seed = xxh3_64(key bytes)`, G = 0x9E3779B97F4A7C15
and P = 0xD6E8FEB86659FD93 (odd 64-bit multipliers, products mod 2^64). Every word depends on
the key, the page and its position, so a chunk loaded into the wrong slot, a page of the wrong
layer, a shifted or torn copy, or stale bytes never verify. Cost: one numpy
XOR per page (no random generator), so generation and checking run near memory bandwidth.
"""
from __future__ import annotations

import functools

import numpy as np
import xxhash

#: Odd 64-bit multipliers (2^64 / golden ratio, and a splitmix constant) for word and page.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_PAGE = 0xD6E8FEB86659FD93


class PayloadMismatchError(RuntimeError):
    """A loaded chunk's bytes differ from what its key generates: the run is invalid."""


def chunk_seed(key_bytes: bytes) -> np.uint64:
    """The 64-bit seed of a chunk from its serialised key (`ChunkKey.to_bytes()`)."""
    return np.uint64(xxhash.xxh3_64_intdigest(key_bytes))


@functools.lru_cache(maxsize=8)
def _pattern(nwords: int) -> np.ndarray:
    out = np.arange(nwords, dtype=np.uint64)
    out *= _GOLDEN
    out.flags.writeable = False
    return out


def _words(buf: np.ndarray, what: str) -> np.ndarray:
    if buf.dtype != np.uint8 or buf.ndim != 1 or buf.nbytes % 8:
        raise ValueError(f"{what} must be a 1-D uint8 array whose size is a multiple of 8 "
                         f"bytes, got dtype {buf.dtype}, shape {buf.shape}")
    return buf.view(np.uint64)


def _page_seed(seed: np.uint64, page: int) -> np.uint64:
    return seed ^ np.uint64(((page + 1) * _PAGE) & 0xFFFF_FFFF_FFFF_FFFF)


def fill_page(dst: np.ndarray, seed: np.uint64, page: int) -> None:
    """Write page `page` (0-based layer index) of the chunk with `seed` into `dst` (uint8,
    shape (page_bytes,), page_bytes a multiple of 8).

    Raises:
        ValueError: `dst` is not a 1-D uint8 array of a multiple of 8 bytes.
    """
    words = _words(dst, "dst")
    np.bitwise_xor(_pattern(words.size), _page_seed(seed, page), out=words)


def page_matches(src: np.ndarray, seed: np.uint64, page: int) -> bool:
    """True iff `src` holds exactly what `fill_page(src, seed, page)` writes (same errors)."""
    words = _words(src, "src")
    return bool(np.array_equal(words ^ _page_seed(seed, page), _pattern(words.size)))
