"""The self-describing chunk record shared by every storage tier (fs files, obj objects).

A chunk record is a header block of `HEADER_BYTES` followed by the payload, zero-padded to a
multiple of `ALIGN` (so the fs tier can write and read a whole record with O_DIRECT):

    offset 0     header fields (little-endian, `_FIXED` then the serialised key), then an
                 xxh3-64 digest of every header byte before it, then zeros up to HEADER_BYTES
    HEADER_BYTES payload (`payload_nbytes` bytes), zeros up to the next multiple of ALIGN

Header fields: magic `b"KVHALCHK"`, format version (u16), flags (u16, 0), header bytes (u32),
payload bytes (u64), namespace digest (16 B), xxh3-128 digest of the payload (16 B, the
canonical big-endian digest of `xxhash.xxh3_128_digest`), serialised key length (u8), the key
(`ChunkKey.to_bytes`).

A reader trusts nothing: `checked_header` refuses a bad magic, version, size, header digest,
namespace or key, and `verify_record` checks the record's length against the header and the
payload against its checksum. A tier reports any of these as a failed job (a miss).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from kvhal.keys import ChunkKey, KeyFormatError

MAGIC = b"KVHALCHK"
FORMAT_VERSION = 1
#: Bytes of the header block, and the O_DIRECT alignment of buffers, offsets and lengths.
ALIGN = 4096
HEADER_BYTES = ALIGN

_FIXED = struct.Struct("<8sHHIQ16s16sB")
_DIGEST = struct.Struct("<Q")
#: Byte offset of the payload checksum in the header block (after magic … namespace).
CHECKSUM_OFFSET = struct.calcsize("<8sHHIQ16s")


class FormatError(ValueError):
    """A chunk record's header is malformed; the message says which field."""


class CorruptChunk(Exception):
    """A stored chunk failed a check (header, size, key or checksum); args[0] says which.

    Attributes:
        file_id: fs tier: (st_dev, st_ino, st_ctime_ns) of the file that was read, to tell a
            file damaged at rest from one replaced or rewritten while it was read; None when
            unknown.
    """

    file_id: tuple[int, int, int] | None = None


class SizeMismatch(Exception):
    """A valid chunk record holds a payload of another size than the one requested."""


@dataclass(frozen=True, slots=True)
class Header:
    """The decoded header of a chunk record.

    Attributes:
        key: The chunk's key (its namespace is the record's namespace digest).
        payload_nbytes: Payload bytes.
        checksum: xxh3-128 digest of the payload, 16 bytes.
    """

    key: ChunkKey
    payload_nbytes: int
    checksum: bytes


def round_up(nbytes: int) -> int:
    """`nbytes` rounded up to a multiple of `ALIGN`."""
    return -(-nbytes // ALIGN) * ALIGN


def record_nbytes(payload_nbytes: int) -> int:
    """Exact size in bytes of the record (file or object) holding `payload_nbytes` of payload."""
    return HEADER_BYTES + round_up(payload_nbytes)


def payload_checksum(payload: memoryview | bytes) -> bytes:
    """xxh3-128 digest (16 bytes) of `payload`."""
    return xxhash.xxh3_128_digest(payload)


def encode_header(out: memoryview, key: ChunkKey, payload_nbytes: int, checksum: bytes) -> None:
    """Write the header block for a chunk into `out` (exactly `HEADER_BYTES` bytes, zeroed
    past the header fields)."""
    digest_at = encode_header_fields(out, key, payload_nbytes, checksum)
    out[digest_at:digest_at + _DIGEST.size] = _DIGEST.pack(
        xxhash.xxh3_64_intdigest(out[:digest_at]))


def encode_header_fields(out: memoryview, key: ChunkKey, payload_nbytes: int,
                         checksum: bytes = bytes(16)) -> int:
    """Write the header block for a chunk into `out` (exactly `HEADER_BYTES` bytes, zeroed
    past the header fields) without its header digest, and return the digest's byte offset.

    A writer that computes the checksum elsewhere (the fs tier's C helper) then stores the
    16-byte payload checksum at `CHECKSUM_OFFSET` and the little-endian xxh3-64 of
    `out[:offset]` at the returned offset, as `encode_header` does.
    """
    key_bytes = key.to_bytes()
    fields = _FIXED.pack(MAGIC, FORMAT_VERSION, 0, HEADER_BYTES, payload_nbytes, key.namespace,
                         checksum, len(key_bytes)) + key_bytes
    out[:len(fields)] = fields
    out[len(fields):HEADER_BYTES] = bytes(HEADER_BYTES - len(fields))
    return len(fields)


def decode_header(block: memoryview | bytes, expected: ChunkKey | None = None) -> Header:
    """Parse and check a header block (at least the header fields' bytes). A key that
    serialises as `expected` is returned as `expected` itself (no second key is built: the
    load path, once per chunk).

    Raises:
        FormatError: bad magic, unknown version, bad header size, header digest mismatch or a
            malformed key.
    """
    if len(block) < _FIXED.size:
        raise FormatError(f"header too short: {len(block)} bytes")
    magic, version, _flags, hdr, nbytes, namespace, checksum, key_len = _FIXED.unpack_from(block)
    if magic != MAGIC:
        raise FormatError(f"bad magic {bytes(magic)!r}")
    if version != FORMAT_VERSION:
        raise FormatError(f"unknown format version {version}")
    if hdr != HEADER_BYTES:
        raise FormatError(f"header size {hdr} != {HEADER_BYTES}")
    end = _FIXED.size + key_len
    if len(block) < end + _DIGEST.size:
        raise FormatError("header truncated inside the key")
    (digest,) = _DIGEST.unpack_from(block, end)
    if digest != xxhash.xxh3_64_intdigest(block[:end]):
        raise FormatError("header digest mismatch")
    key_bytes = bytes(block[_FIXED.size:end])
    if expected is not None and key_bytes == expected.to_bytes():
        key = expected
    else:
        try:
            key = ChunkKey.from_bytes(key_bytes)
        except KeyFormatError as exc:
            raise FormatError(f"bad key: {exc}") from None
    if key.namespace != namespace:
        raise FormatError("key namespace differs from header namespace")
    return Header(key, nbytes, bytes(checksum))


def checked_header(block: memoryview | bytes, key: ChunkKey | None,
                   namespace: bytes) -> Header:
    """Decode a header block and check that it belongs to `namespace` (and to `key` unless
    None).

    Raises:
        CorruptChunk: malformed header (see `decode_header`), another namespace or another key.
    """
    try:
        header = decode_header(block, key)
    except FormatError as exc:
        raise CorruptChunk(str(exc)) from None
    if header.key.namespace != namespace:
        raise CorruptChunk("namespace digest differs from the tier's")
    if key is not None and header.key != key:
        raise CorruptChunk("record holds another key than its name says")
    return header


def check_record_size(header: Header, record_size: int, requested_nbytes: int | None) -> None:
    """Check a record's total size against its header and the payload size a load asked for.

    Raises:
        CorruptChunk: `record_size` is not `record_nbytes(header.payload_nbytes)` (torn, cut
            short or padded by something else).
        SizeMismatch: a well-formed record whose payload is not `requested_nbytes` bytes.
    """
    expected = record_nbytes(header.payload_nbytes)
    if record_size != expected:
        raise CorruptChunk(f"record size {record_size} != expected {expected}")
    if requested_nbytes is not None and header.payload_nbytes != requested_nbytes:
        raise SizeMismatch(f"payload {header.payload_nbytes} bytes != requested "
                           f"{requested_nbytes}")


def verify_payload(header: Header, payload: memoryview | bytes) -> None:
    """Check `payload` against the header's length and xxh3-128 checksum.

    Raises:
        CorruptChunk: short payload or checksum mismatch.
    """
    if len(payload) != header.payload_nbytes:
        raise CorruptChunk(f"short payload: {len(payload)} of {header.payload_nbytes} bytes")
    if payload_checksum(payload) != header.checksum:
        raise CorruptChunk("checksum mismatch")
