"""Object names of the obj tier: content-addressed, one object per chunk record.

    <prefix>/<namespace hex>/<ChunkKey.hex()>.kv

(no leading "<prefix>/" when the prefix is empty). The leaf name is the fs tier's chunk file
name (`kvhal.tiers.fs.format`), so one parser serves both tiers; each object holds exactly one
chunk record of `kvhal.tiers.chunk_format`.
"""
from __future__ import annotations

from kvhal.keys import ChunkKey

from ..fs.format import CHUNK_SUFFIX, is_namespace_dir_name, key_from_name


def namespace_prefix(prefix: str, namespace: bytes) -> str:
    """The name prefix (ending in "/") of every object of `namespace`."""
    return f"{prefix}/{namespace.hex()}/" if prefix else f"{namespace.hex()}/"


def object_name(ns_prefix: str, key: ChunkKey) -> str:
    """The object name of `key` under `namespace_prefix(...)`."""
    return ns_prefix + key.hex() + CHUNK_SUFFIX


def key_from_object(ns_prefix: str, namespace: bytes, name: str) -> ChunkKey | None:
    """The key an object name under `ns_prefix` stands for, or None if it names no chunk."""
    if not name.startswith(ns_prefix):
        return None
    return key_from_name(namespace, name[len(ns_prefix):])


def namespace_of(prefix: str, name: str) -> bytes | None:
    """The namespace digest of an object name under `prefix` (the first segment after it), or
    None if that segment is not a namespace's hex digest."""
    rest = name[len(prefix) + 1:] if prefix else name
    segment = rest.split("/", 1)[0]
    return bytes.fromhex(segment) if is_namespace_dir_name(segment) else None
