"""Deterministic payloads: each chunk's bytes depend on its key, its page and the position."""
from __future__ import annotations

import numpy as np
import pytest

from kvhal.integrations.harness.payload import chunk_seed, fill_page, page_matches

PAGE = 4096


def page(seed, p: int = 0) -> np.ndarray:
    buf = np.zeros(PAGE, dtype=np.uint8)
    fill_page(buf, seed, p)
    return buf


def test_same_key_same_bytes_and_first_word():
    seed = chunk_seed(b"key-1")
    a, b = page(seed), page(seed)
    assert np.array_equal(a, b)
    assert page_matches(a, seed, 0)
    word0 = int(seed) ^ 0xD6E8FEB86659FD93  # word 0 of page 0: 0*G ^ seed ^ 1*P
    assert int(a[:8].view(np.uint64)[0]) == word0


@pytest.mark.parametrize("damage", ["other key", "other page", "shifted", "one bit", "stale"])
def test_every_kind_of_wrong_bytes_is_caught(damage):
    seed = chunk_seed(b"key-1")
    buf = page(seed)
    if damage == "other key":
        buf = page(chunk_seed(b"key-2"))
    elif damage == "other page":
        buf = page(seed, 1)
    elif damage == "shifted":
        buf = np.roll(buf, 8)
    elif damage == "one bit":
        buf[PAGE - 1] ^= 1
    else:
        buf[:] = 0
    assert not page_matches(buf, seed, 0)


def test_bad_buffer_is_refused():
    with pytest.raises(ValueError, match="dst must be a 1-D uint8 array whose size is a "
                                         "multiple of 8 bytes"):
        fill_page(np.zeros(12, dtype=np.uint8), chunk_seed(b"k"), 0)
