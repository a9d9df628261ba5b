"""The two request bodies of a disaggregated request, in vLLM's p2p tier protocol (0.32).

Pure functions: a client's OpenAI body in, the prefill leg's and the decode leg's bodies out.
No I/O, no state; the proxy (`proxy.py`) decides where each leg goes and when.

Merging with the client's own `kv_transfer_params`: every key the client sent is kept on both
legs (e.g. `max_offload_tokens`, or a `remote_kv_source` for load balancing), except the one
role key the proxy sets on a leg — `remote_decoder` on the prefill leg, `remote_prefiller` on
the decode leg — which replaces the client's value of that key. The client's
`remote_prefiller` is also dropped from the prefill leg and its `remote_decoder` from the decode
leg: a prefiller told to pull as a decoder, or a decoder told to park its chunks, would break
the pair the proxy sets up. The client's body is never modified in place.
"""
from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Keys of `kv_transfer_params` naming a leg's role (vLLM `tiering/p2p/manager.py`).
REMOTE_DECODER = "remote_decoder"
REMOTE_PREFILLER = "remote_prefiller"
#: Body keys the prefill leg drops: `stream_options` is refused by vLLM without `stream`;
#: `min_tokens` above the leg's one token is refused as more than `max_tokens`.
_PREFILL_DROPS = ("stream_options", "min_tokens")


class BodyError(ValueError):
    """A client body the proxy cannot split into legs; the message names the offending key."""


def client_params(body: Mapping[str, Any]) -> dict[str, Any]:
    """The client's `kv_transfer_params` (a copy), `{}` when absent or null.

    Raises:
        BodyError: `kv_transfer_params` is present and not a JSON object.
    """
    params = body.get("kv_transfer_params")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise BodyError(f"kv_transfer_params: must be a JSON object, got "
                        f"{type(params).__name__}")
    return copy.deepcopy(params)


def prefill_body(body: Mapping[str, Any], request_id: str, *, chat: bool) -> dict[str, Any]:
    """The prefill leg: the client's body computing one token, not streamed, parking its KV.

    Args:
        body: The client's `/v1/completions` or `/v1/chat/completions` JSON object.
        request_id: The orchestrator's `kv_request_id` shared by both legs.
        chat: True for `/v1/chat/completions` (also sets `max_completion_tokens: 1`).

    Returns:
        A new dict: `body` with `max_tokens: 1`, `stream: false`, no `stream_options` nor
        `min_tokens`, and `kv_transfer_params` = the client's (see the module docstring) with
        `remote_decoder: {"kv_request_id": request_id}`.

    Raises:
        BodyError: the client's `kv_transfer_params` is not an object.
    """
    params = client_params(body)
    params.pop(REMOTE_PREFILLER, None)
    params[REMOTE_DECODER] = {"kv_request_id": request_id}
    out = {k: copy.deepcopy(v) for k, v in body.items() if k not in _PREFILL_DROPS}
    out.update(max_tokens=1, stream=False, kv_transfer_params=params)
    if chat:
        out["max_completion_tokens"] = 1
    return out


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """Where a decoder pulls a request's KV from: the `remote_prefiller` of the decode leg.

    Attributes:
        kv_request_id: The id the prefill leg parked the KV under.
        remote_host: The prefiller's p2p host, as its p2p tier is reached by decoders.
        remote_port: The prefiller's p2p port plus the data-parallel rank that served the
            prefill leg (vLLM binds one p2p socket per DP rank, at `port + rank`).
    """

    kv_request_id: str
    remote_host: str
    remote_port: int


def decode_body(body: Mapping[str, Any], remote: RemotePrefill | None) -> dict[str, Any]:
    """The decode leg: the client's body, pulling the prompt's KV from the named prefiller.

    Args:
        body: The client's JSON object.
        remote: The prefill leg's prefiller and id; None when no prefill leg parks KV for
            this request (no prefiller, or its leg failed first): then the body carries no
            `remote_prefiller` and the decoder computes the whole prompt itself.

    Returns:
        A new dict: `body` with `kv_transfer_params` = the client's (see the module
        docstring) with `remote_prefiller: {"kv_request_id", "remote_host", "remote_port"}`;
        `kv_transfer_params` is left out when it would be empty.

    Raises:
        BodyError: the client's `kv_transfer_params` is not an object.
    """
    params = client_params(body)
    params.pop(REMOTE_DECODER, None)
    params.pop(REMOTE_PREFILLER, None)
    if remote is not None:
        params[REMOTE_PREFILLER] = {"kv_request_id": remote.kv_request_id,
                                    "remote_host": remote.remote_host,
                                    "remote_port": remote.remote_port}
    out = {k: copy.deepcopy(v) for k, v in body.items() if k != "kv_transfer_params"}
    if params:
        out["kv_transfer_params"] = params
    return out
