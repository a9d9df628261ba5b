"""On-disk format of the fs tier: one self-describing file per chunk (DESIGN §6).

A chunk file is a header block of `HEADER_BYTES` followed by the payload, zero-padded to a
multiple of `ALIGN` so that the whole file can be written and read with O_DIRECT:

    offset 0     header fields (little-endian, `_FIXED` then the serialised key), then an
                 xxh3-64 digest of every header byte before it, then zeros up to HEADER_BYTES
    HEADER_BYTES payload (`payload_nbytes` bytes), zeros up to the next multiple of ALIGN

Header fields: magic `b"KVHALCHK"`, format version (u16), flags (u16, 0), header bytes (u32),
payload bytes (u64), namespace digest (16 B), xxh3-128 digest of the payload (16 B, the
canonical big-endian digest of `xxhash.xxh3_128_digest`), serialised key length (u8), the key
(`ChunkKey.to_bytes`).

Directory layout under `root_dir`:

    <namespace hex>/chunks/<first hash byte hex>/<ChunkKey.hex()>.kv   chunk files
    <namespace hex>/tmp/<ChunkKey.hex()>.<pid>.<random hex>.tmp          files being written
    <namespace hex>/quarantine/<ChunkKey.hex()>.kv.<time ns>.<random hex> files that failed checks
"""
from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass

import xxhash

from kvhal.keys import NAMESPACE_BYTES, ChunkKey, KeyFormatError

MAGIC = b"KVHALCHK"
FORMAT_VERSION = 1
#: Bytes of the header block, and the O_DIRECT alignment of buffers, offsets and lengths.
ALIGN = 4096
HEADER_BYTES = ALIGN
CHUNK_SUFFIX = ".kv"
TEMP_SUFFIX = ".tmp"
CHUNKS_DIR, TEMP_DIR, QUARANTINE_DIR = "chunks", "tmp", "quarantine"

_FIXED = struct.Struct("<8sHHIQ16s16sB")
_DIGEST = struct.Struct("<Q")
_NAME_RE = re.compile(r"^([0-9a-f]{4})-((?:[0-9a-f]{2}){1,64})\.kv$")
_TEMP_RE = re.compile(r"^[0-9a-f]{4}-[0-9a-f]+\.(\d+)\.[0-9a-f]+\.tmp$")


class FormatError(ValueError):
    """A chunk file's header is malformed; the message says which field."""


@dataclass(frozen=True, slots=True)
class Header:
    """The decoded header of a chunk file.

    Attributes:
        key: The chunk's key (its namespace is the file's namespace digest).
        payload_nbytes: Payload bytes.
        checksum: xxh3-128 digest of the payload, 16 bytes.
    """

    key: ChunkKey
    payload_nbytes: int
    checksum: bytes


def round_up(nbytes: int) -> int:
    """`nbytes` rounded up to a multiple of `ALIGN`."""
    return -(-nbytes // ALIGN) * ALIGN


def file_nbytes(payload_nbytes: int) -> int:
    """Exact size in bytes of the chunk file holding `payload_nbytes` of payload."""
    return HEADER_BYTES + round_up(payload_nbytes)


def payload_checksum(payload: memoryview | bytes) -> bytes:
    """xxh3-128 digest (16 bytes) of `payload`."""
    return xxhash.xxh3_128_digest(payload)


def encode_header(out: memoryview, key: ChunkKey, payload_nbytes: int, checksum: bytes) -> None:
    """Write the header block for a chunk into `out` (exactly `HEADER_BYTES` bytes, zeroed
    past the header fields)."""
    key_bytes = key.to_bytes()
    fields = _FIXED.pack(MAGIC, FORMAT_VERSION, 0, HEADER_BYTES, payload_nbytes, key.namespace,
                         checksum, len(key_bytes)) + key_bytes
    body = fields + _DIGEST.pack(xxhash.xxh3_64_intdigest(fields))
    out[:len(body)] = body
    out[len(body):HEADER_BYTES] = bytes(HEADER_BYTES - len(body))


def decode_header(block: memoryview | bytes) -> Header:
    """Parse and check a header block (at least the header fields' bytes).

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
    if digest != xxhash.xxh3_64_intdigest(bytes(block[:end])):
        raise FormatError("header digest mismatch")
    try:
        key = ChunkKey.from_bytes(bytes(block[_FIXED.size:end]))
    except KeyFormatError as exc:
        raise FormatError(f"bad key: {exc}") from None
    if key.namespace != namespace:
        raise FormatError("key namespace differs from header namespace")
    return Header(key, nbytes, bytes(checksum))


def namespace_dir(root_dir: str, namespace: bytes) -> str:
    """Folder of one namespace under `root_dir`."""
    return os.path.join(root_dir, namespace.hex())


def chunk_path(ns_dir: str, key: ChunkKey) -> str:
    """Content-addressed path of the chunk file of `key` inside its namespace folder."""
    return os.path.join(ns_dir, CHUNKS_DIR, f"{key.block_hash[0]:02x}", key.hex() + CHUNK_SUFFIX)


def temp_path(ns_dir: str, key: ChunkKey) -> str:
    """A fresh temp-file path for writing `key`: unique per process (pid) and per call
    (64 random bits), so writers in several processes never share one."""
    return os.path.join(ns_dir, TEMP_DIR,
                        f"{key.hex()}.{os.getpid()}.{os.urandom(8).hex()}{TEMP_SUFFIX}")


def key_from_name(namespace: bytes, name: str) -> ChunkKey | None:
    """The key a chunk file name stands for, or None if `name` is not a chunk file name."""
    m = _NAME_RE.match(name)
    if m is None:
        return None
    return ChunkKey(namespace, int(m.group(1), 16), bytes.fromhex(m.group(2)))


def temp_owner_pid(name: str) -> int | None:
    """The writer pid encoded in a temp-file name, or None if `name` is not one."""
    m = _TEMP_RE.match(name)
    return int(m.group(1)) if m else None


def is_namespace_dir_name(name: str) -> bool:
    """True if `name` looks like a namespace folder (hex of a 16-byte digest)."""
    return len(name) == 2 * NAMESPACE_BYTES and all(c in "0123456789abcdef" for c in name)
