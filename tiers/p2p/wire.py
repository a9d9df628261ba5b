"""The p2p wire format: length-prefixed msgpack control frames, checked field by field.

A frame is a 4-byte big-endian body length (at most `MAX_FRAME_BYTES`) and a msgpack map
body. Decoding trusts nothing: msgpack's own limits cap every string, binary, array and map
(no ext types, no non-string map keys; never pickle), then `decode` checks the message type
`t` and every field of that type against `SCHEMAS` (type, exact or maximum length, integer
range) and refuses unknown fields. Any failure raises `WireError`; the caller counts it and
drops the connection. Chunk payloads travel outside frames (`transport.py`), announced by a
`chunk` frame with their exact length and followed by an `end` frame with their xxh3-128
digest.

Messages (`t`, fields) — handshake in `auth.py`, feed and pulls in `server.py` / `client.py`:
    hello(v, role, nonce, id)   challenge(nonce, mac)   auth(mac)   ok()
    snap(epoch, seq, keys, last)        ev(epoch, seq, gain, lose)
    hb(epoch, seq)              get(key, n)     chunk(key, n, gen)    end(sum)    miss(why)
    busy()      fetch(id, key, n, wait_ms)      done(id, gen)   probe(keys)     held(keys)
    (P/D: `parking.py`; `gen` is a parked record's generation, 0 for a `get` / a decoder that
    fetched nothing; `done` is answered `ok`; `probe` is answered `held` with the keys of it
    the peer holds, `probe.py`)
"""
from __future__ import annotations

import struct
from typing import Any

import msgpack

from kvhal.keys import ChunkKey, KeyFormatError

#: Version 2: `chunk` and `done` carry a parked record's generation (`parking.py`);
#: `probe` / `held` ask a peer which chunks it holds (`probe.py`).
PROTOCOL_VERSION = 2
#: Largest control frame body: a feed page of `MAX_KEYS_PER_FRAME` keys fits with room.
MAX_FRAME_BYTES = 1 << 20
#: Keys per `snap` / `ev` frame (each serialised key is at most 83 bytes).
MAX_KEYS_PER_FRAME = 4096
#: Largest chunk a peer may announce or ask for.
MAX_CHUNK_BYTES = 1 << 31
NONCE_BYTES = 16
MAC_BYTES = 32
EPOCH_BYTES = 16
_MAX_KEY_BYTES = 16 + 3 + 64
#: Longest orchestrator `kv_request_id` (characters; `orchestration.py`).
MAX_ID_CHARS = 200
#: Longest wait a fetch may ask for (ms).
MAX_WAIT_MS = 600_000
_MAX_SEQ = (1 << 63) - 1
LENGTH = struct.Struct(">I")

#: field -> ("bin", min, max) | ("int", lo, hi) | ("str", max) | ("bool",) | ("key",) | ("keys",)
SCHEMAS: dict[str, dict[str, tuple]] = {
    "hello": {"v": ("int", 0, 1 << 16), "role": ("str", 8), "nonce": ("bin", NONCE_BYTES,
              NONCE_BYTES), "id": ("str", 300)},
    "challenge": {"nonce": ("bin", NONCE_BYTES, NONCE_BYTES), "mac": ("bin", MAC_BYTES,
                  MAC_BYTES)},
    "auth": {"mac": ("bin", MAC_BYTES, MAC_BYTES)},
    "ok": {},
    "snap": {"epoch": ("bin", EPOCH_BYTES, EPOCH_BYTES), "seq": ("int", 0, _MAX_SEQ),
             "keys": ("keys",), "last": ("bool",)},
    "ev": {"epoch": ("bin", EPOCH_BYTES, EPOCH_BYTES), "seq": ("int", 1, _MAX_SEQ),
           "gain": ("keys",), "lose": ("keys",)},
    "hb": {"epoch": ("bin", EPOCH_BYTES, EPOCH_BYTES), "seq": ("int", 0, _MAX_SEQ)},
    "get": {"key": ("key",), "n": ("int", 1, MAX_CHUNK_BYTES)},
    "chunk": {"key": ("key",), "n": ("int", 1, MAX_CHUNK_BYTES), "gen": ("int", 0, _MAX_SEQ)},
    "end": {"sum": ("bin", 16, 16)},
    "miss": {"why": ("str", 200)},
    "busy": {},
    "fetch": {"id": ("str", MAX_ID_CHARS), "key": ("key",), "n": ("int", 1, MAX_CHUNK_BYTES),
              "wait_ms": ("int", 0, MAX_WAIT_MS)},
    "done": {"id": ("str", MAX_ID_CHARS), "gen": ("int", 0, _MAX_SEQ)},
    "probe": {"keys": ("keys",)},
    "held": {"keys": ("keys",)},
}


class WireError(Exception):
    """A peer sent a malformed, oversized or unexpected message; args[0] says what. The
    connection it came on must be dropped."""


def encode(t: str, **fields: Any) -> bytes:
    """One frame (length prefix + msgpack body) of message type `t`; `key`, `keys`, `gain`
    and `lose` fields take `ChunkKey`s (serialised with `ChunkKey.to_bytes`).

    Raises:
        WireError: the body would exceed `MAX_FRAME_BYTES` (a bug of the sender).
    """
    body = {"t": t}
    for name, value in fields.items():
        kind = SCHEMAS[t][name][0]
        body[name] = ([k.to_bytes() for k in value] if kind == "keys"
                      else value.to_bytes() if kind == "key" else value)
    data = msgpack.packb(body, use_bin_type=True)
    if len(data) > MAX_FRAME_BYTES:
        raise WireError(f"frame of {len(data)} bytes exceeds {MAX_FRAME_BYTES}")
    return LENGTH.pack(len(data)) + data


def frame_length(prefix: bytes) -> int:
    """Body length from a 4-byte prefix.

    Raises:
        WireError: zero or over `MAX_FRAME_BYTES`.
    """
    (n,) = LENGTH.unpack(prefix)
    if not 0 < n <= MAX_FRAME_BYTES:
        raise WireError(f"frame length {n} outside 1..{MAX_FRAME_BYTES}")
    return n


def _refuse_ext(code: int, data: bytes) -> Any:
    raise WireError(f"msgpack ext type {code} refused")


def decode(body: bytes, *expected: str) -> dict[str, Any]:
    """Decode and check one frame body; keys come back as `ChunkKey`s.

    Args:
        body: The msgpack bytes after the length prefix.
        expected: Message types acceptable here (empty: any known type).

    Returns:
        The message as a dict with "t" and exactly the fields of its schema.

    Raises:
        WireError: not msgpack, not a map, unknown or unexpected type, a missing, unknown or
            out-of-bounds field, a malformed key, or trailing bytes.
    """
    try:
        msg = msgpack.unpackb(body, raw=False, use_list=True, strict_map_key=True,
                              ext_hook=_refuse_ext,
                              max_str_len=1024, max_bin_len=_MAX_KEY_BYTES,
                              max_array_len=MAX_KEYS_PER_FRAME, max_map_len=16)
    except WireError:
        raise
    except Exception as exc:  # msgpack raises several types (ExtraData, ValueError, ...)
        raise WireError(f"undecodable frame ({type(exc).__name__})") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise WireError("frame is not a map with a string 't'")
    t = msg["t"]
    schema = SCHEMAS.get(t)
    if schema is None or (expected and t not in expected):
        raise WireError(f"unexpected message type {t[:32]!r}")
    if set(msg) != set(schema) | {"t"}:
        extra = sorted(set(msg) ^ (set(schema) | {"t"}))
        raise WireError(f"{t}: missing or unknown fields {extra[:4]}")
    for name, spec in schema.items():
        msg[name] = _check(t, name, spec, msg[name])
    return msg


def _check(t: str, name: str, spec: tuple, value: Any) -> Any:
    kind = spec[0]
    if kind == "int":
        if type(value) is not int or not spec[1] <= value <= spec[2]:
            raise WireError(f"{t}.{name}: integer in {spec[1]}..{spec[2]} expected")
    elif kind == "bin":
        if type(value) is not bytes or not spec[1] <= len(value) <= spec[2]:
            raise WireError(f"{t}.{name}: {spec[1]}..{spec[2]} bytes expected")
    elif kind == "str":
        if type(value) is not str or len(value) > spec[1]:
            raise WireError(f"{t}.{name}: string of at most {spec[1]} characters expected")
    elif kind == "bool":
        if type(value) is not bool:
            raise WireError(f"{t}.{name}: bool expected")
    elif kind == "key":
        return decode_key(value, f"{t}.{name}")
    else:  # keys
        if type(value) is not list:
            raise WireError(f"{t}.{name}: list of keys expected")
        return [decode_key(k, f"{t}.{name}") for k in value]
    return value


def decode_key(data: Any, where: str = "key") -> ChunkKey:
    """A `ChunkKey` from its wire bytes.

    Raises:
        WireError: not bytes or not a well-formed serialised key.
    """
    if type(data) is not bytes or len(data) > _MAX_KEY_BYTES:
        raise WireError(f"{where}: serialised key expected")
    try:
        return ChunkKey.from_bytes(data)
    except KeyFormatError as exc:
        raise WireError(f"{where}: {exc}") from None
