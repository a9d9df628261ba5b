"""An orchestrator's per-request instructions to the p2p tier, in vLLM 0.32's key names.

A router or P/D proxy puts them in a request's `kv_transfer_params` (vLLM's p2p tier
protocol, `vllm/v1/kv_offload/tiering/p2p/manager.py`; llm-d's router speaks it too):

- prefill leg: `{"remote_decoder": {"kv_request_id": ID}}` (usually with `max_tokens: 1`):
  this instance parks the request's chunks under ID until a decode leg fetched them
  (`parking.py`);
- decode leg: `{"remote_prefiller": {"kv_request_id": ID, "remote_host": H,
  "remote_port": P}}`: this instance pulls the prompt's chunks parked under ID from the
  prefiller at H:P (its p2p `port` + its data-parallel index), waiting for chunks not stored
  yet; no directory is needed;
- load balancing: `{"remote_kv_source": {same three keys}}`: pull the prompt's chunks the
  peer H:P holds (by key; nothing is parked). `remote_prefiller` wins over it.

The orchestrator invents ID (it must be unguessable if tenants share an auth key: a fetch
needs both). Malformed parameters are logged as a warning naming the key and the request and
treated as absent (no orchestration), never raised: one request must not take the engine
down.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Hashable, Mapping

from .wire import MAX_ID_CHARS

logger = logging.getLogger(__name__)

REMOTE_DECODER = "remote_decoder"
REMOTE_PREFILLER = "remote_prefiller"
REMOTE_KV_SOURCE = "remote_kv_source"

Peer = tuple[str, int]


@dataclass(frozen=True, slots=True)
class Orchestration:
    """What one request's `kv_transfer_params` ask of the p2p tier.

    Attributes:
        park_id: Prefill leg: park the request's chunks under this id (None: not a leg).
        fetch_id: Decode leg / load balancing: the id to pull under (None: pull nothing).
        source: The peer to pull from, (host, port); set exactly when `fetch_id` is.
        parked: True for a decode leg (`remote_prefiller`: the source parks the chunks
            under the id, and the pull waits for them), False for `remote_kv_source`.
    """

    park_id: str | None = None
    fetch_id: str | None = None
    source: Peer | None = None
    parked: bool = False


def _kv_id(block: Mapping[str, Any], where: str, request: Hashable) -> str | None:
    kv_id = block.get("kv_request_id")
    if not isinstance(kv_id, str) or not 0 < len(kv_id) <= MAX_ID_CHARS:
        logger.warning("request %s: kv_transfer_params.%s.kv_request_id must be a string of "
                       "1..%d characters, got %s; ignored (no orchestration)", request, where,
                       MAX_ID_CHARS, _shown(kv_id))
        return None
    return kv_id


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _port(value: Any) -> int | None:
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 65535:
        return value
    return None


def _source(block: Any, where: str, request: Hashable) -> tuple[str, Peer] | None:
    if not isinstance(block, Mapping):
        logger.warning("request %s: kv_transfer_params.%s must be an object with "
                       "kv_request_id, remote_host, remote_port, got %s; ignored (no "
                       "orchestration)", request, where, type(block).__name__)
        return None
    host, port = block.get("remote_host"), _port(block.get("remote_port"))
    if not isinstance(host, str) or not host or any(c.isspace() for c in host):
        logger.warning("request %s: kv_transfer_params.%s.remote_host must be a host name or "
                       "address, got %s; ignored (no orchestration)", request, where,
                       _shown(host))
        return None
    if port is None:
        logger.warning("request %s: kv_transfer_params.%s.remote_port must be a port in "
                       "1..65535 (the peer's p2p port + its data-parallel index), got %s; "
                       "ignored (no orchestration)", request, where,
                       _shown(block.get("remote_port")))
        return None
    kv_id = _kv_id(block, where, request)
    if kv_id is None:
        return None
    return kv_id, (host[1:-1] if host.startswith("[") and host.endswith("]") else host, port)


def parse(params: Any, request: Hashable) -> Orchestration | None:
    """The p2p orchestration of a request's `kv_transfer_params` (see module docstring), or
    None if it asks nothing of the p2p tier. Never raises: a malformed block is logged
    (warning naming `request` and the key) and ignored."""
    if not isinstance(params, Mapping):
        return None
    park_id = None
    if REMOTE_DECODER in params:
        block = params[REMOTE_DECODER]
        if isinstance(block, Mapping):
            park_id = _kv_id(block, REMOTE_DECODER, request)
        else:
            logger.warning("request %s: kv_transfer_params.%s must be an object with "
                           "kv_request_id, got %s; ignored (no orchestration)", request,
                           REMOTE_DECODER, type(block).__name__)
    found = None
    where = (REMOTE_PREFILLER if REMOTE_PREFILLER in params
             else REMOTE_KV_SOURCE if REMOTE_KV_SOURCE in params else None)
    if where is not None:      # remote_prefiller wins, even malformed (as vLLM's tier)
        found = _source(params[where], where, request)
    if park_id is None and found is None:
        return None
    fetch_id, source = found if found is not None else (None, None)
    return Orchestration(park_id, fetch_id, source, found is not None
                         and where == REMOTE_PREFILLER)
