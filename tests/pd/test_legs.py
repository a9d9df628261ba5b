"""The prefill and decode legs' bodies (`kvhal.integrations.pd.legs`), value for value."""
from __future__ import annotations

import copy

import pytest

from kvhal.integrations.pd.legs import BodyError, RemotePrefill, decode_body, prefill_body

CLIENT = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 16, "temperature": 0,
          "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 4,
          "kv_transfer_params": {"max_offload_tokens": 128,
                                 "remote_kv_source": {"kv_request_id": "lb",
                                                      "remote_host": "h", "remote_port": 1},
                                 "remote_decoder": {"kv_request_id": "client's"},
                                 "remote_prefiller": {"kv_request_id": "client's"}}}
REMOTE = RemotePrefill("ID", "10.0.0.5", 7101)


def test_prefill_leg_computes_one_token_unstreamed_and_parks_under_the_id():
    """Fails when a key of the prefill leg is wrong: e.g. with `stream_options` kept (vLLM
    refuses it without `stream`) or the client's `remote_prefiller` passed on."""
    assert prefill_body(CLIENT, "ID", chat=False) == {
        "model": "m", "prompt": [5, 6, 7], "max_tokens": 1, "temperature": 0, "stream": False,
        "kv_transfer_params": {"max_offload_tokens": 128,
                               "remote_kv_source": {"kv_request_id": "lb", "remote_host": "h",
                                                    "remote_port": 1},
                               "remote_decoder": {"kv_request_id": "ID"}}}


def test_chat_prefill_leg_also_caps_max_completion_tokens():
    """Fails when `max_completion_tokens` is left to the client (vLLM prefers it over
    `max_tokens`): e.g. with the `chat` branch removed."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 9}
    assert prefill_body(body, "ID", chat=True) == {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "max_completion_tokens": 1, "stream": False,
        "kv_transfer_params": {"remote_decoder": {"kv_request_id": "ID"}}}


def test_decode_leg_is_the_client_body_pulling_from_the_prefiller():
    """Fails when the decode leg differs from the client's body beyond `remote_prefiller`:
    e.g. with the client's `remote_decoder` kept (the decoder would park its KV)."""
    want = copy.deepcopy(CLIENT)
    want["kv_transfer_params"] = {
        "max_offload_tokens": 128,
        "remote_kv_source": {"kv_request_id": "lb", "remote_host": "h", "remote_port": 1},
        "remote_prefiller": {"kv_request_id": "ID", "remote_host": "10.0.0.5",
                             "remote_port": 7101}}
    assert decode_body(CLIENT, REMOTE) == want


def test_decode_leg_without_prefill_carries_no_params():
    """Fails when a decode leg without a prefill leg still names a prefiller, or sends an
    empty `kv_transfer_params`."""
    body = {"model": "m", "prompt": [1], "kv_transfer_params": {"remote_prefiller": {}}}
    assert decode_body(body, None) == {"model": "m", "prompt": [1]}


def test_the_client_body_is_not_modified():
    """Fails when a leg edits the client's dict in place (the other leg would see it)."""
    before = copy.deepcopy(CLIENT)
    prefill_body(CLIENT, "ID", chat=True)
    decode_body(CLIENT, REMOTE)
    assert CLIENT == before


@pytest.mark.parametrize("params", [[1], "x", 3], ids=["list", "str", "int"])
def test_params_that_are_not_an_object_are_refused_by_name(params):
    """Fails when a non-object `kv_transfer_params` is accepted or the error does not name
    the key."""
    with pytest.raises(BodyError, match="kv_transfer_params: must be a JSON object"):
        prefill_body({"kv_transfer_params": params}, "ID", chat=False)
    with pytest.raises(BodyError, match="kv_transfer_params: must be a JSON object"):
        decode_body({"kv_transfer_params": params}, REMOTE)
