"""kvhal's KV events as vLLM's (`vllm/distributed/kv_events.py`), with what routers match on.

The engine names a chunk by the hash of its last block (`kvhal.events`), and that hash is all
kvhal can look a chunk up by. So each chunk a tier gains is one `BlockStored` at chunk
granularity: `block_hashes = [hash of the chunk's last block]`, `parent_block_hash` = the hash
of the block before the chunk (None for a prompt's first chunk), `token_ids` = the chunk's
`blocks_per_chunk * block_size` tokens, `block_size` = tokens per chunk (so
`len(token_ids) == len(block_hashes) * block_size`, as in every vLLM event); `lora_id` /
`lora_name` of the request's LoRA, `group_idx`, `kv_cache_spec_kind` /
`kv_cache_spec_sliding_window` of the group. A recurrent-state group's chunk (Mamba) is a state
checkpoint at its last hash and carries no token ids, as in vLLM 0.34. A router that credits
only an announced hash's full prefix never predicts a hit kvhal cannot serve (announcing every
block hash of a chunk, as vLLM's own offloading connector does with `blocks_per_chunk` > 1,
would promise prefixes that end inside a chunk). With `blocks_per_chunk: 1` an event is exactly
vLLM's self-describing offloading event (`offloading/events.py`) for the same chunk
(`tests/vllm/test_events_like_vllm.py` compares them field by field). A removal names the same
one hash. Hashes go through vLLM's `maybe_convert_block_hash` (bytes, or int64 under
`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`).

`medium` and `locality` are what vLLM's own tier of that medium publishes: the host tier is
vLLM's CPU primary tier (medium "CPU", locality unset); a secondary tier gives its own
(`SecondaryTier.medium`, `.locality`: fs "STORAGE"/"LOCAL", obj "STORAGE"/"REMOTE", mooncake
and p2p "CPU"/"REMOTE"). `ownership` stays unset, as vLLM's fs and obj tiers leave it (only its
kvcr tier sets it; a router reads an owned block as not this instance's).

The request is needed to describe a chunk and is at hand only when the chunk is planned for a
store or found in a secondary tier for a promotion (`record`); the description is kept while
any tier holds the chunk, and `describe` hands it, encoded (`ChunkDescription.encode`), to the
engine for the tiers that persist it beside the chunk (the fs tier), so that a restarted
instance announces what it finds with its tokens and parent (`BlockStored.descriptions`), parents
before children. A chunk found without a description (written by an older kvhal, or while
events were off) is announced with its hash only, like vLLM's placeholder events (token ids
empty, `block_size` 0). `AllBlocksCleared` carries no medium in vLLM and means "this instance's
prefix cache is empty" to a router, so clearing the host tier is published as a `BlockRemoved`
of every chunk it held instead.
"""
from __future__ import annotations

import array
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import msgspec
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvhal import events
from kvhal.keys import ChunkKey

#: `kv_cache_spec_kind` of recurrent-state groups (Mamba): their events carry no token ids.
RECURRENT_KIND = "mamba"
#: Version of `ChunkDescription.encode`'s layout (first element of the encoded array).
DESCRIPTION_VERSION = 1


@dataclass(slots=True)
class ChunkDescription:
    """What a router needs of a chunk besides its hash (persisted by the tiers that can).

    Attributes:
        parent: vLLM hash (bytes) of the block before the chunk; None for a prompt's first.
        token_ids: The chunk's tokens (`blocks_per_chunk * block_size` of them).
        lora_id: The request's LoRA adapter id, or None.
        lora_name: The request's LoRA name, or None.
        tiers: Labels of the tiers that hold the chunk now (not persisted).
    """

    parent: bytes | None
    token_ids: array.array
    lora_id: int | None = None
    lora_name: str | None = None
    tiers: set[str] = field(default_factory=set)

    def encode(self) -> bytes:
        """msgpack array `[DESCRIPTION_VERSION, parent, token ids (int64 little-endian bytes),
        lora_id, lora_name]`; later versions may append elements."""
        tokens = array.array("q", self.token_ids)
        if sys.byteorder == "big":
            tokens.byteswap()
        return msgspec.msgpack.encode([DESCRIPTION_VERSION, self.parent, tokens.tobytes(),
                                       self.lora_id, self.lora_name])

    @classmethod
    def decode(cls, data: bytes) -> "ChunkDescription | None":
        """The description `encode` wrote, or None if `data` is not one (unknown version,
        wrong types, truncated): such a chunk is announced as a placeholder."""
        try:
            fields = msgspec.msgpack.decode(data)
            version, parent, tokens, lora_id, lora_name = fields[:5]
            if (version < DESCRIPTION_VERSION or not isinstance(tokens, bytes)
                    or len(tokens) % 8 or not isinstance(parent, (bytes, type(None)))
                    or not isinstance(lora_id, (int, type(None)))
                    or not isinstance(lora_name, (str, type(None)))):
                return None
        except (msgspec.DecodeError, TypeError, ValueError):
            return None
        token_ids = array.array("q")
        token_ids.frombytes(tokens)
        if sys.byteorder == "big":
            token_ids.byteswap()
        return cls(parent, token_ids, lora_id, lora_name)


#: `kv_cache_spec_kind`, `kv_cache_spec_sliding_window` of a group (vLLM's event fields).
GroupSpec = tuple["str | None", "int | None"]


def group_specs(kv_cache_config: Any) -> dict[int, GroupSpec]:
    """Per KV cache group index, the spec fields vLLM's offloading events carry
    (`offloading/events.py` `get_offloading_event_group_spec`); empty where this vLLM has no
    `get_kv_cache_spec_kind`."""
    try:
        from vllm.v1.kv_cache_interface import (get_kv_cache_spec_kind,
                                                get_kv_cache_spec_sliding_window)
    except ImportError:
        return {}
    return {i: (get_kv_cache_spec_kind(g.kv_cache_spec).value,
                get_kv_cache_spec_sliding_window(g.kv_cache_spec))
            for i, g in enumerate(getattr(kv_cache_config, "kv_cache_groups", ()))}


class ChunkEvents:
    """Describes chunks while requests are at hand and translates the engine's events.

    Args:
        block_size: vLLM's block size in tokens.
        blocks_per_chunk: vLLM blocks per kvhal chunk.
        max_pending: Chunks described but not yet stored anywhere kept at most (older ones
            are forgotten: their store failed or never ran).
        specs: `group_specs` of the engine's KV cache groups (groups not in it: None, None).
    """

    def __init__(self, block_size: int, blocks_per_chunk: int, max_pending: int,
                 specs: Mapping[int, GroupSpec] | None = None):
        self.block_size = block_size
        self.blocks_per_chunk = blocks_per_chunk
        self._max_pending = max_pending
        self._specs = dict(specs or {})
        self._pending: OrderedDict[tuple[int, bytes], ChunkDescription] = OrderedDict()
        self._held: dict[tuple[int, bytes], ChunkDescription] = {}

    @property
    def tokens_per_chunk(self) -> int:
        """`block_size` of every described chunk's event."""
        return self.block_size * self.blocks_per_chunk

    def __len__(self) -> int:
        """Chunks described (held by a tier or pending)."""
        return len(self._pending) + len(self._held)

    def record(self, key: ChunkKey, request: Any, chunk: int) -> None:
        """Describe chunk number `chunk` of `request` (vLLM `Request`: `block_hashes`,
        `all_token_ids`, `lora_request`), whose key is `key`, unless it is already described."""
        k = (key.group, key.block_hash)
        if k in self._held or k in self._pending:
            return
        first, tpc = chunk * self.blocks_per_chunk, self.tokens_per_chunk
        lora = getattr(request, "lora_request", None)
        self._pending[k] = ChunkDescription(
            request.block_hashes[first - 1] if first else None,
            array.array("q", request.all_token_ids[chunk * tpc:(chunk + 1) * tpc]),
            None if lora is None else lora.adapter_id, None if lora is None else lora.name)
        if len(self._pending) > self._max_pending:
            self._pending.popitem(last=False)

    def describe(self, key: ChunkKey) -> bytes | None:
        """`key`'s description, encoded for a tier to keep beside the chunk, or None if it
        is not described (`Manager.describe`)."""
        k = (key.group, key.block_hash)
        desc = self._held.get(k) or self._pending.get(k)
        return None if desc is None else desc.encode()

    def translate(self, engine_events: Iterable[Any]) -> list:
        """vLLM events for `engine_events` (from `Manager.take_events`), in order."""
        out: list = []
        for event in engine_events:
            if isinstance(event, events.BlockStored):
                out.extend(self._stored(event))
            elif isinstance(event, events.BlockRemoved):
                out.append(self._removed(event.block_hashes, event.group, event))
            else:
                out.extend(self._cleared(event))
        return out

    @staticmethod
    def _locality(event: Any) -> str | None:
        """vLLM's locality for `event`'s tier: unset for the host tier (vLLM's CPU tier)."""
        return None if event.tier == events.HOST_TIER else event.locality

    def _stored(self, event: events.BlockStored) -> Iterable[BlockStored]:
        found = event.descriptions or (None,) * len(event.block_hashes)
        chunks = []
        for h, data in zip(event.block_hashes, found):
            k = (event.group, h)
            chunk = self._held.get(k) or self._pending.pop(k, None)
            if chunk is None and data is not None:
                chunk = ChunkDescription.decode(data)
            if chunk is not None:
                self._held[k] = chunk
                chunk.tiers.add(event.tier)
            chunks.append((h, chunk))
        if event.descriptions:      # found in a tier: parents before children
            chunks = _parents_first(chunks)
        kind, window = self._specs.get(event.group, (None, None))
        for h, chunk in chunks:
            if chunk is None:
                parent, tokens, block_size, lora_id, lora_name = None, [], 0, None, None
            else:
                parent = None if chunk.parent is None else maybe_convert_block_hash(chunk.parent)
                tokens, block_size = chunk.token_ids.tolist(), len(chunk.token_ids)
                lora_id, lora_name = chunk.lora_id, chunk.lora_name
                if kind == RECURRENT_KIND:  # a state checkpoint, not a token range (vLLM 0.34)
                    tokens = []
            yield BlockStored(block_hashes=[maybe_convert_block_hash(h)],
                              parent_block_hash=parent, token_ids=tokens,
                              block_size=block_size, lora_id=lora_id, medium=event.medium,
                              lora_name=lora_name, group_idx=event.group,
                              kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window,
                              locality=self._locality(event))

    def _removed(self, block_hashes: Iterable[bytes], group: int, where: Any) -> BlockRemoved:
        hashes = []
        for h in block_hashes:
            hashes.append(maybe_convert_block_hash(h))
            k = (group, h)
            chunk = self._held.get(k)
            if chunk is not None:
                chunk.tiers.discard(where.tier)
                if not chunk.tiers:
                    del self._held[k]
        return BlockRemoved(block_hashes=hashes, medium=where.medium, group_idx=group,
                            locality=self._locality(where))

    def _cleared(self, event: events.AllBlocksCleared) -> Iterable[BlockRemoved]:
        by_group: dict[int, list[bytes]] = {}
        for (group, h), chunk in list(self._held.items()):
            if event.tier in chunk.tiers:
                by_group.setdefault(group, []).append(h)
        return [self._removed(hashes, group, event) for group, hashes in by_group.items()]


def _parents_first(chunks: list[tuple[bytes, ChunkDescription | None]]
                   ) -> list[tuple[bytes, ChunkDescription | None]]:
    """`chunks` ordered so that a chunk whose parent is among them comes after it (by depth
    of the parent chain within `chunks`; stable otherwise)."""
    parent = {h: (c.parent if c is not None else None) for h, c in chunks}
    depth: dict[bytes, int] = {}

    def depth_of(h: bytes) -> int:
        path, cur = [], h
        while cur not in depth and cur not in path:
            path.append(cur)
            p = parent[cur]
            if p is None or p not in parent:
                break
            cur = p
        d = depth[cur] if cur in depth and cur not in path else -1
        for node in reversed(path):
            d += 1
            depth[node] = d
        return depth[h]

    return sorted(chunks, key=lambda hc: depth_of(hc[0]))
