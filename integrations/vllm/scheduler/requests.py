"""What the scheduler side knows of each live vLLM request: its state (`RequestState`), its
chunk keys, and vLLM's block table (`VllmBlocks`)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kvhal.config import EngineConfig
from kvhal.engine import Manager
from kvhal.keys import chunk_keys
from kvhal.weights import WeightsError

from ..geometry import Deployment
from ..identity import AdapterIdentities

logger = logging.getLogger(__name__)

#: Key of the per-request cap in `SamplingParams.extra_args["kv_transfer_params"]`.
MAX_OFFLOAD_TOKENS = "max_offload_tokens"


@dataclass(slots=True)
class RequestState:
    """What the scheduler side tracks per live request."""

    request: Any
    max_offload_tokens: int | None
    # Identity of the request's LoRA adapter (its keys' scope), None for the base model.
    adapter: bytes | None = None
    # False: the request's KV is neither looked up nor stored (its adapter is unknown).
    reuse: bool = True
    num_stored_chunks: int = 0      # chunks stored or being stored, in order (`StorePlanner`)
    store_jobs: set[int] = field(default_factory=set)
    # Chunk range of the hit found by the last get_num_new_matched_tokens.
    load_start: int = 0
    load_end: int = 0
    hit_tokens: dict[str, int] = field(default_factory=dict)    # tier label → tokens
    # The last update_state_after_alloc's hit tokens by vLLM cache-hit source.
    hit_sources: dict[str, int] = field(default_factory=dict)
    # First chunk a group failed to load: later hits end before it.
    max_hit_chunks: int | None = None
    # The last lookup's hit loads asynchronously (vLLM was told is_async=True).
    async_hit: bool = False
    # Wall-clock times (time.time(), s) of this request's load phases (`timeline`).
    times: dict[str, float] = field(default_factory=dict)

    def cap_hits(self, chunk: int) -> None:
        """Later hits end before `chunk` (a group failed to load it)."""
        self.max_hit_chunks = (chunk if self.max_hit_chunks is None
                               else min(self.max_hit_chunks, chunk))


@dataclass(slots=True)
class VllmBlocks:
    """vLLM's block table, bound by the connector (`bind_kv_cache_manager`).

    Attributes:
        kv_cache_manager: vLLM's `KVCacheManager` (a request's block ids; frees a request).
        null_block_id: vLLM's null block (the stand-in for blocks a sliding window dropped).
    """

    kv_cache_manager: Any = None
    null_block_id: int = 0


class RequestTable:
    """The live requests' states, by vLLM request id, and their chunk keys.

    Args:
        deployment: Geometry (`blocks_per_chunk`).
        config: The kvhal config (`max_offload_tokens` default).
        namespace: 16-byte namespace of the engine's chunks.
        manager: The engine's manager (per-request parameters go to its tiers).
    """

    def __init__(self, deployment: Deployment, config: EngineConfig, namespace: bytes,
                 manager: Manager):
        self.namespace = namespace
        self.adapters = AdapterIdentities()
        self._blocks_per_chunk = deployment.blocks_per_chunk
        self._default_cap = config.max_offload_tokens
        self._manager = manager
        self._states: dict[str, RequestState] = {}

    def get(self, request_id: str) -> RequestState | None:
        """The state of a request seen before, else None."""
        return self._states.get(request_id)

    def pop(self, request_id: str) -> RequestState | None:
        """Forget a request; its state, or None if it was never seen."""
        return self._states.pop(request_id, None)

    def state(self, request: Any) -> RequestState:
        """The state of `request`, made on first sight: its `max_offload_tokens` (from its
        `kv_transfer_params`, else the config's; an invalid value stores nothing), its adapter,
        and its parameters handed to the tiers (`Manager.open_request`)."""
        request_id = request.request_id
        state = self._states.get(request_id)
        if state is None:
            params = request.kv_transfer_params or {}
            cap = params.get(MAX_OFFLOAD_TOKENS, self._default_cap)
            if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 0):
                # One request's bad parameter must not take the engine down: store nothing.
                logger.warning("request %s: kv_transfer_params.%s must be an integer ≥ 0, got "
                               "%r; nothing of it is offloaded", request_id,
                               MAX_OFFLOAD_TOKENS, cap)
                cap = 0
            adapter, reuse = self._adapter(request)
            state = self._states[request_id] = RequestState(
                request, cap if reuse else 0, adapter, reuse)
            if params:   # orchestration for the tiers (p2p: P/D legs), once per request
                self._manager.open_request(request_id, params)
        return state

    def keys(self, request: Any, group: int = 0) -> list:
        """The chunk keys of `request`'s full chunks in `group`, in order."""
        state = self._states.get(request.request_id)
        return chunk_keys(request.block_hashes, self._blocks_per_chunk, self.namespace, group,
                          None if state is None else state.adapter)

    def _adapter(self, request: Any) -> tuple[bytes | None, bool]:
        """(identity of the request's LoRA adapter or None, whether its KV may be reused and
        stored): an adapter kvhal cannot fingerprint (`AdapterIdentities.of`) gets neither."""
        lora = getattr(request, "lora_request", None)
        try:
            return self.adapters.of(lora), True
        except WeightsError as exc:
            logger.warning("request %s: LoRA adapter %r cannot be fingerprinted (%s); its KV "
                           "is neither reused nor stored", request.request_id,
                           getattr(lora, "lora_name", "?"), exc)
            return None, False
