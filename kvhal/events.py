"""KV events (DESIGN §8): what the engine tells routers about where chunks live.

Field names follow vLLM's `vllm/distributed/kv_events.py` (`BlockStored.block_hashes`,
`.medium`; `BlockRemoved`; `AllBlocksCleared`) so an integration can forward them as vLLM's
msgpack events; fields kvhal does not know (token ids, parent hash, LoRA) are the integration's
to fill. Block hashes are the hashes of each chunk's last block (the chunk key's `block_hash`).
Events reach every `kvhal_kv_event` hook implementation through `kvhal.plugins.emit_kv_event`.
"""
from __future__ import annotations

from dataclasses import dataclass

#: `medium` of the host tier, as vLLM names its CPU offload medium.
HOST_MEDIUM = "CPU"


@dataclass(frozen=True, slots=True)
class _BlockEvent:
    block_hashes: tuple[bytes, ...]
    group: int
    medium: str
    locality: str = "local"


@dataclass(frozen=True, slots=True)
class BlockStored(_BlockEvent):
    """Chunks became readable in `medium` (the host tier, or a secondary tier by type name).

    Attributes:
        block_hashes: Last-block hash of each chunk, in prefix order.
        group: KV cache group of the chunks.
        medium: "CPU" for the host tier, else the secondary tier's type name upper-cased.
        locality: "local" (this instance) or the name of a peer.
    """


@dataclass(frozen=True, slots=True)
class BlockRemoved(_BlockEvent):
    """Chunks left `medium` (evicted or discarded); attributes as `BlockStored`."""


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every chunk left `medium`."""

    medium: str
    locality: str = "local"
