"""The chunk record shared by fs and obj: header round trip, any flipped header bit is
detected, record sizes, and the checks a reader applies."""
from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from kvhal.keys import ChunkKey
from kvhal.tiers.chunk_format import (HEADER_BYTES, CorruptChunk, FormatError, SizeMismatch,
                                      check_record_size, checked_header, decode_header,
                                      encode_header, payload_checksum, record_nbytes,
                                      verify_payload)

from .helpers import NAMESPACE

KEY = ChunkKey(NAMESPACE, 3, bytes(range(32)))


def _header(payload_nbytes: int = 12345, key: ChunkKey = KEY) -> bytearray:
    block = bytearray(HEADER_BYTES)
    encode_header(memoryview(block), key, payload_nbytes, payload_checksum(b"abc"))
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


def test_record_size_is_header_plus_padded_payload():
    assert [record_nbytes(n) for n in (1, 4096, 4097)] == [8192, 8192, 12288]


def test_checked_header_refuses_another_key_and_another_namespace():
    other = ChunkKey(NAMESPACE, 3, bytes(32))
    with pytest.raises(CorruptChunk, match="another key"):
        checked_header(_header(), other, NAMESPACE)
    with pytest.raises(CorruptChunk, match="namespace"):
        checked_header(_header(), None, bytes(16))
    assert checked_header(_header(), KEY, NAMESPACE).key == KEY


def test_record_size_checks_tell_torn_records_from_other_sizes():
    header = decode_header(_header(5000))
    check_record_size(header, 12288, 5000)
    with pytest.raises(CorruptChunk, match="record size 8192 != expected 12288"):
        check_record_size(header, 8192, 5000)
    with pytest.raises(SizeMismatch, match="payload 5000 bytes != requested 4000"):
        check_record_size(header, 12288, 4000)


def test_verify_payload_catches_short_and_flipped_payloads():
    header = decode_header(_header(3))
    verify_payload(header, b"abc")
    with pytest.raises(CorruptChunk, match="short payload: 2 of 3"):
        verify_payload(header, b"ab")
    with pytest.raises(CorruptChunk, match="checksum mismatch"):
        verify_payload(header, b"abd")
