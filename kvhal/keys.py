"""Chunk keys (DESIGN §4): what names a chunk in every tier.

A chunk key is `(namespace, group, hash of the chunk's last block)`. The namespace digest covers
everything that makes two caches incompatible (model, dtype, format, chunking, hash function,
tenant salt), so caches that must not mix never share keys.
"""
from __future__ import annotations

from dataclasses import dataclass

#: Bytes of a namespace digest.
NAMESPACE_BYTES = 16
_MAX_HASH_BYTES = 64


class KeyFormatError(ValueError):
    """A key or its serialised form is malformed; the message names the field."""


@dataclass(frozen=True, slots=True)
class ChunkKey:
    """The key of one chunk.

    Attributes:
        namespace: 16-byte namespace digest.
        group: KV cache group index (vLLM's group id; 0 for single-group models), 0..65535.
        block_hash: Hash of the chunk's last block (32 bytes for sha256, 8 for xxhash, ...).
    """

    namespace: bytes
    group: int
    block_hash: bytes

    def __post_init__(self) -> None:
        if len(self.namespace) != NAMESPACE_BYTES:
            raise KeyFormatError(f"namespace must be {NAMESPACE_BYTES} bytes, got "
                            f"{len(self.namespace)}")
        if not 0 <= self.group <= 0xFFFF:
            raise KeyFormatError(f"group must be in 0..65535, got {self.group}")
        if not 1 <= len(self.block_hash) <= _MAX_HASH_BYTES:
            raise KeyFormatError(f"block_hash must be 1..{_MAX_HASH_BYTES} bytes, got "
                            f"{len(self.block_hash)}")

    def to_bytes(self) -> bytes:
        """Serialise as namespace(16) ‖ group(2, big-endian) ‖ len(1) ‖ block_hash."""
        return (self.namespace + self.group.to_bytes(2, "big")
                + bytes([len(self.block_hash)]) + self.block_hash)

    @classmethod
    def from_bytes(cls, data: bytes) -> "ChunkKey":
        """Inverse of `to_bytes`.

        Raises:
            KeyFormatError: the bytes are truncated or have trailing garbage.
        """
        if len(data) < NAMESPACE_BYTES + 3:
            raise KeyFormatError(f"serialised chunk key too short: {len(data)} bytes")
        n = data[NAMESPACE_BYTES + 2]
        if len(data) != NAMESPACE_BYTES + 3 + n:
            raise KeyFormatError(f"serialised chunk key length {len(data)} does not match its "
                            f"hash length {n}")
        return cls(data[:NAMESPACE_BYTES], int.from_bytes(data[NAMESPACE_BYTES:NAMESPACE_BYTES + 2],
                                                          "big"), data[NAMESPACE_BYTES + 3:])

    def hex(self) -> str:
        """A filesystem/URL-safe name: `<group>-<block_hash hex>` (namespace is the folder)."""
        return f"{self.group:04x}-{self.block_hash.hex()}"
