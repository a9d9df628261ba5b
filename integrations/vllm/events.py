"""kvhal's KV events as vLLM's (`vllm/distributed/kv_events.py`), with what routers match on.

The engine names a chunk by the hash of its last block (`kvhal.events`). A router (llm-d,
Dynamo) matches the per-block hashes vLLM publishes for its GPU blocks, so every chunk event
here carries the same thing vLLM's own offloading connector publishes for a chunk
(`offloading/events.py`, "self-describing" events): the hashes of each of the chunk's
`blocks_per_chunk` blocks, the hash of the block before it (`parent_block_hash`), the chunk's
token ids and vLLM's block size; a removal fans out to the same block hashes. Block hashes go
through vLLM's `maybe_convert_block_hash` (bytes, or int64 under
`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`), exactly as vLLM's GPU events.

The request is needed to describe a chunk and is at hand only when the chunk is planned for a
store or found in a secondary tier for a promotion (`record`); the description is kept while
any tier holds the chunk. A chunk the tracker never saw (one a previous process stored) is
announced with its last block hash only, like vLLM's placeholder events. `AllBlocksCleared`
carries no medium in vLLM and means "this instance's prefix cache is empty" to a router, so
clearing the host tier is published as a `BlockRemoved` of every chunk it held instead.
"""
from __future__ import annotations

import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvhal import events
from kvhal.keys import ChunkKey


@dataclass(slots=True)
class _Chunk:
    block_hashes: tuple[bytes, ...]
    parent: bytes | None
    token_ids: array.array
    tiers: set[str] = field(default_factory=set)   # tier labels that hold the chunk


class ChunkEvents:
    """Describes chunks while requests are at hand and translates the engine's events.

    Args:
        block_size: vLLM's block size in tokens.
        blocks_per_chunk: vLLM blocks per kvhal chunk.
        max_pending: Chunks described but not yet stored anywhere kept at most (older ones
            are forgotten: their store failed or never ran).
    """

    def __init__(self, block_size: int, blocks_per_chunk: int, max_pending: int):
        self.block_size = block_size
        self.blocks_per_chunk = blocks_per_chunk
        self._max_pending = max_pending
        self._pending: OrderedDict[tuple[int, bytes], _Chunk] = OrderedDict()
        self._held: dict[tuple[int, bytes], _Chunk] = {}

    def __len__(self) -> int:
        """Chunks described (held by a tier or pending)."""
        return len(self._pending) + len(self._held)

    def record(self, key: ChunkKey, request: Any, chunk: int) -> None:
        """Describe chunk number `chunk` of `request` (vLLM `Request`: `block_hashes`,
        `all_token_ids`), whose key is `key`, unless it is already described."""
        k = (key.group, key.block_hash)
        if k in self._held or k in self._pending:
            return
        bpc, tpc = self.blocks_per_chunk, self.blocks_per_chunk * self.block_size
        first = chunk * bpc
        self._pending[k] = _Chunk(tuple(request.block_hashes[first:first + bpc]),
                                  request.block_hashes[first - 1] if first else None,
                                  array.array("l", request.all_token_ids[chunk * tpc:
                                                                         (chunk + 1) * tpc]))
        if len(self._pending) > self._max_pending:
            self._pending.popitem(last=False)

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

    def _stored(self, event: events.BlockStored) -> Iterable[BlockStored]:
        ownership = None if event.tier == events.HOST_TIER else event.tier
        for h in event.block_hashes:
            k = (event.group, h)
            chunk = self._held.get(k) or self._pending.pop(k, None)
            if chunk is not None:
                self._held[k] = chunk
                chunk.tiers.add(event.tier)
                hashes = [maybe_convert_block_hash(b) for b in chunk.block_hashes]
                parent = None if chunk.parent is None else maybe_convert_block_hash(chunk.parent)
                tokens, block_size = chunk.token_ids.tolist(), self.block_size
            else:
                hashes, parent, tokens, block_size = [maybe_convert_block_hash(h)], None, [], 0
            yield BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                              block_size=block_size, lora_id=None, medium=event.medium,
                              lora_name=None, group_idx=event.group, locality=event.locality,
                              ownership=ownership)

    def _removed(self, block_hashes: Iterable[bytes], group: int, where: Any) -> BlockRemoved:
        hashes = []
        for h in block_hashes:
            k = (group, h)
            chunk = self._held.get(k)
            if chunk is None:
                hashes.append(maybe_convert_block_hash(h))
                continue
            hashes.extend(maybe_convert_block_hash(b) for b in chunk.block_hashes)
            chunk.tiers.discard(where.tier)
            if not chunk.tiers:
                del self._held[k]
        return BlockRemoved(block_hashes=hashes, medium=where.medium, group_idx=group,
                            locality=where.locality,
                            ownership=None if where.tier == events.HOST_TIER else where.tier)

    def _cleared(self, event: events.AllBlocksCleared) -> Iterable[BlockRemoved]:
        by_group: dict[int, list[bytes]] = {}
        for (group, h), chunk in list(self._held.items()):
            if event.tier in chunk.tiers:
                by_group.setdefault(group, []).append(h)
        return [self._removed(hashes, group, event) for group, hashes in by_group.items()]
