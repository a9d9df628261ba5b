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
needs both). Nothing here raises: one request must not take the engine down.

- A malformed `remote_prefiller` / `remote_kv_source` block is logged as a warning naming the
  key and the request and treated as absent (nothing is pulled; the request computes), as
  vLLM's `_parse_source` returns None for an incomplete block.
- A malformed `remote_decoder` block (present and not null, but not an object, or whose
  `kv_request_id` is not a string of 1..`MAX_ID_CHARS` characters) still marks a prefill leg:
  it is logged as an error naming the request, the key and the bad value, and every store of
  the request to the p2p tier fails with that reason (`Orchestration.park_error`; the chunks
  stay in the host tier, nothing is parked). That is what vLLM 0.32's tier does
  (`vllm/v1/kv_offload/tiering/p2p/manager.py`: `_parse_dest` keeps a present block without a
  `kv_request_id` as `P2PDestInfo(kv_request_id=None)`, "the block's presence still marks the
  request as remote-decode, so submit_store must fail rather than store locally", and
  `P2PSecondaryTierManager.submit_store` then fails the job, "submit_store missing
  kv_request_id"). Where vLLM does worse kvhal fails the stores too: a block that is not an
  object makes `_parse_dest` raise (AttributeError from `role.get`), and an id that is not a
  string parks chunks no decoder can fetch (`FetchMsg.validate` requires a str) until reaped.
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
        park_error: A prefill leg whose `remote_decoder` block is malformed: why, naming the
            key and the value (`park_id` is then None); every store of the request to the
            p2p tier fails with it (module docstring).
    """

    park_id: str | None = None
    fetch_id: str | None = None
    source: Peer | None = None
    parked: bool = False
    park_error: str | None = None


def _id_problem(block: Mapping[str, Any], where: str) -> str | None:
    """Why `block`'s kv_request_id is unusable (naming the key path and the value), or None."""
    kv_id = block.get("kv_request_id")
    if isinstance(kv_id, str) and 0 < len(kv_id) <= MAX_ID_CHARS:
        return None
    return (f"kv_transfer_params.{where}.kv_request_id must be a string of 1..{MAX_ID_CHARS} "
            f"characters, got {_shown(kv_id)}")


def _park_id(block: Any) -> tuple[str | None, str | None]:
    """(kv_request_id, None) of a well-formed `remote_decoder` block, else (None, why)."""
    if not isinstance(block, Mapping):
        return None, (f"kv_transfer_params.{REMOTE_DECODER} must be an object with "
                      f"kv_request_id, got {type(block).__name__} {_shown(block)}")
    why = _id_problem(block, REMOTE_DECODER)
    return (block["kv_request_id"], None) if why is None else (None, why)


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
    why = _id_problem(block, where)
    if why is not None:
        logger.warning("request %s: %s; ignored (no orchestration)", request, why)
        return None
    return block["kv_request_id"], (host[1:-1] if host.startswith("[") and host.endswith("]")
                                    else host, port)


def parse(params: Any, request: Hashable) -> Orchestration | None:
    """The p2p orchestration of a request's `kv_transfer_params` (see module docstring), or
    None if it asks nothing of the p2p tier. Never raises: a malformed pull block is logged
    (warning naming `request` and the key) and ignored; a malformed `remote_decoder` block
    (a null one is absent, as in vLLM) is logged as an error naming `request`, the key and
    the value, and returned as `park_error`."""
    if not isinstance(params, Mapping):
        return None
    park_id = park_error = None
    if params.get(REMOTE_DECODER) is not None:
        park_id, park_error = _park_id(params[REMOTE_DECODER])
        if park_error is not None:
            logger.error("request %s: %s; its stores to the p2p tier fail (as vLLM's p2p tier "
                         "fails them), nothing is parked for its decoder", request, park_error)
    found = None
    where = (REMOTE_PREFILLER if REMOTE_PREFILLER in params
             else REMOTE_KV_SOURCE if REMOTE_KV_SOURCE in params else None)
    if where is not None:      # remote_prefiller wins, even malformed (as vLLM's tier)
        found = _source(params[where], where, request)
    if park_id is None and park_error is None and found is None:
        return None
    fetch_id, source = found if found is not None else (None, None)
    return Orchestration(park_id, fetch_id, source, found is not None
                         and where == REMOTE_PREFILLER, park_error)
