"""p2p wire format: every message round-trips; anything else is a WireError, never a crash
(fuzzed with hypothesis), and the decoder never unpickles or builds ext types."""
from __future__ import annotations

import os
import pickle

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhal.tiers.p2p.wire import (LENGTH, MAX_FRAME_BYTES, SCHEMAS, WireError, decode, encode,
                                  frame_length)

from .helpers import NAMESPACE, chunk_key

KEY = chunk_key(NAMESPACE, 1)
EPOCH = bytes(range(16))
VALID = {
    "hello": dict(v=2, role="data", nonce=os.urandom(16), id="127.0.0.1:5000"),
    "challenge": dict(nonce=os.urandom(16), mac=os.urandom(32)),
    "auth": dict(mac=os.urandom(32)),
    "ok": {},
    "snap": dict(epoch=EPOCH, seq=0, keys=[KEY, chunk_key(NAMESPACE, 2)], last=True),
    "ev": dict(epoch=EPOCH, seq=7, gain=[KEY], lose=[]),
    "hb": dict(epoch=EPOCH, seq=7),
    "get": dict(key=KEY, n=2 << 20),
    "chunk": dict(key=KEY, n=2 << 20, gen=3),
    "end": dict(sum=os.urandom(16)),
    "miss": dict(why="not held"),
    "busy": {},
    "fetch": dict(id="pd-6f1c", key=KEY, n=2 << 20, wait_ms=30_000),
    "done": dict(id="pd-6f1c", gen=3),
    "probe": dict(keys=[KEY, chunk_key(NAMESPACE, 2)]),
    "held": dict(keys=[KEY]),
}


def test_every_message_type_has_a_valid_example():
    assert sorted(VALID) == sorted(SCHEMAS)


@pytest.mark.parametrize("t", sorted(VALID))
def test_message_round_trips(t):
    frame = encode(t, **VALID[t])
    assert frame_length(frame[:4]) == len(frame) - 4
    assert decode(frame[4:]) == {"t": t, **VALID[t]}


@pytest.mark.parametrize("body,why", [
    (msgpack.packb([1, 2]), "frame is not a map with a string 't'"),
    (msgpack.packb({"t": "nope"}), "unexpected message type 'nope'"),
    (msgpack.packb({"t": "get", "key": KEY.to_bytes()}), "get: missing or unknown fields ['n']"),
    (msgpack.packb({"t": "get", "key": KEY.to_bytes(), "n": 0}), "get.n: integer in"),
    (msgpack.packb({"t": "get", "key": KEY.to_bytes(), "n": True}), "get.n: integer in"),
    (msgpack.packb({"t": "get", "key": b"short", "n": 5}), "get.key: serialised chunk key"),
    (msgpack.packb({"t": "end", "sum": b"x" * 15}), "end.sum: 16..16 bytes expected"),
    (msgpack.packb({"t": "ok", "extra": 1}), "ok: missing or unknown fields ['extra']"),
    (msgpack.packb({"t": "ok"}) + b"\x00", "undecodable frame (ExtraData)"),
    (msgpack.packb({"t": "hb", "epoch": EPOCH, "seq": msgpack.ExtType(1, b"")}),
     "msgpack ext type 1 refused"),
    (msgpack.packb({"t": "snap", "epoch": EPOCH, "seq": 0, "keys": [b"k"] * 4097,
                    "last": True}), "undecodable frame"),
    (pickle.dumps({"t": "ok"}), "undecodable frame"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_malformed_body_is_refused_with_the_reason(body, why):
    with pytest.raises(WireError) as info:
        decode(body)
    assert str(info.value).startswith(why)


def test_decode_refuses_a_type_not_expected_here():
    with pytest.raises(WireError, match="unexpected message type 'get'"):
        decode(encode("get", **VALID["get"])[4:], "hello")


@pytest.mark.parametrize("n", [0, MAX_FRAME_BYTES + 1, (1 << 32) - 1])
def test_frame_length_out_of_bounds_is_refused(n):
    with pytest.raises(WireError, match=f"frame length {n} outside"):
        frame_length(LENGTH.pack(n))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_decode_or_raise_wire_error(data):
    try:
        msg = decode(data)
    except WireError:
        return
    assert msg["t"] in SCHEMAS


_leaf = (st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats()
         | st.text(max_size=40) | st.binary(max_size=100))
_values = st.recursive(_leaf, lambda inner: st.lists(inner, max_size=5)
                       | st.dictionaries(st.text(max_size=8), inner, max_size=5), max_leaves=20)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(SCHEMAS)), st.dictionaries(st.sampled_from(
    ["v", "role", "nonce", "id", "mac", "epoch", "seq", "keys", "last", "gain", "lose", "key",
     "n", "sum", "why", "x"]), _values, max_size=6))
def test_random_msgpack_maps_decode_or_raise_wire_error(t, fields):
    body = msgpack.packb({"t": t, **fields}, use_bin_type=True)
    try:
        msg = decode(body)
    except WireError:
        return
    assert set(msg) == set(SCHEMAS[t]) | {"t"}


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(sorted(VALID)), st.data())
def test_one_corrupted_byte_never_escapes_as_another_error(t, data):
    frame = bytearray(encode(t, **VALID[t]))
    pos = data.draw(st.integers(4, len(frame) - 1))
    frame[pos] ^= data.draw(st.integers(1, 255))
    try:
        decode(bytes(frame[4:]))
    except WireError:
        pass
