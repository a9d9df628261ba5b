"""The chunk file header: round trip, and any flipped header bit is detected."""
from __future__ import annotations

import os

import pytest
from hypothesis import given, strategies as st

from kvhal.keys import ChunkKey
from kvhal.tiers.fs.format import (HEADER_BYTES, FormatError, decode_header, encode_header,
                                   file_nbytes, key_from_name, payload_checksum, temp_owner_pid,
                                   temp_path)

from .helpers import NAMESPACE

KEY = ChunkKey(NAMESPACE, 3, bytes(range(32)))


def _header(payload_nbytes: int = 12345) -> bytearray:
    block = bytearray(HEADER_BYTES)
    encode_header(memoryview(block), KEY, payload_nbytes, payload_checksum(b"abc"))
    return block


def test_header_round_trip():
    header = decode_header(_header())
    assert (header.key, header.payload_nbytes, header.checksum) == (
        KEY, 12345, payload_checksum(b"abc"))


@given(bit=st.integers(0, (57 + 51 + 8) * 8 - 1))
def test_any_flipped_header_bit_is_a_format_error(bit):
    block = _header()
    block[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(FormatError):
        decode_header(block)


def test_file_size_is_header_plus_padded_payload():
    assert [file_nbytes(n) for n in (1, 4096, 4097)] == [8192, 8192, 12288]


def test_chunk_names_map_back_to_keys():
    assert key_from_name(NAMESPACE, KEY.hex() + ".kv") == KEY
    assert key_from_name(NAMESPACE, KEY.hex() + ".tmp") is None
    assert key_from_name(NAMESPACE, "0003-zz.kv") is None


def test_temp_names_are_unique_and_carry_the_pid():
    names = {os.path.basename(temp_path("/ns", KEY)) for _ in range(1000)}
    assert len(names) == 1000
    assert {temp_owner_pid(n) for n in names} == {os.getpid()}
