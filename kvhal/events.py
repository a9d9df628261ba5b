"""KV events (DESIGN §8): what the engine tells routers about where chunks live.

Field names follow vLLM's `vllm/distributed/kv_events.py` (`BlockStored.block_hashes`,
`.medium`, `.locality`; `BlockRemoved`; `AllBlocksCleared`) so an integration can forward them
as vLLM's msgpack events; fields kvhal does not know (token ids, parent hash, LoRA) are the
integration's to fill: it describes each chunk (`Manager.describe`, opaque bytes), tiers that can
keep the description beside the chunk, and a chunk a tier finds (at start, or by a listing of a
shared store) is announced with the description it kept (`BlockStored.descriptions`). Block
hashes are the hashes of each chunk's last block (the chunk key's `block_hash`). `medium`
and `locality` are vLLM's names (`MEDIUM_CPU`/`MEDIUM_STORAGE`, `Locality.LOCAL`/`REMOTE`):
each secondary tier declares its own (`SecondaryTier.medium`, `.locality`); `tier` names the
tier (its metrics label).
Events reach every `kvhal_kv_event` hook implementation through `kvhal.plugins.emit_kv_event`.
"""
from __future__ import annotations

from dataclasses import dataclass

#: `medium` of the host tier, as vLLM names its CPU offload medium.
HOST_MEDIUM = "CPU"
#: `locality` of a tier on this instance (vLLM `Locality.LOCAL`).
LOCAL = "LOCAL"
#: `tier` of the host tier (its metrics label, `kvhal.metrics.HOST`).
HOST_TIER = "host"


@dataclass(frozen=True, slots=True)
class _BlockEvent:
    block_hashes: tuple[bytes, ...]
    group: int
    medium: str
    locality: str = LOCAL
    tier: str = HOST_TIER


@dataclass(frozen=True, slots=True)
class BlockStored(_BlockEvent):
    """Chunks became readable in `medium` (the host tier, or a secondary tier by type name).

    Attributes:
        block_hashes: Last-block hash of each chunk, in prefix order.
        group: KV cache group of the chunks.
        medium: "CPU" for the host tier, else the secondary tier's `medium` ("CPU", "STORAGE").
        locality: "LOCAL" (on this instance) or "REMOTE" (an object store, a peer).
        tier: "host" or the secondary tier's metrics label (`kvhal.metrics.tier_labels`).
        descriptions: For chunks a tier found rather than stored (`SecondaryTier.take_found`),
            the description it kept of each (None where it kept none), aligned with
            `block_hashes`; empty for chunks this process stored or promoted.
    """

    descriptions: tuple[bytes | None, ...] = ()


@dataclass(frozen=True, slots=True)
class BlockRemoved(_BlockEvent):
    """Chunks left `medium` (evicted or discarded); attributes as `BlockStored`."""


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every chunk left `medium`."""

    medium: str
    locality: str = LOCAL
    tier: str = HOST_TIER
