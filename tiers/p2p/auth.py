"""Mutual HMAC-SHA256 challenge over the peers' shared key (RFC 2104 HMAC, `hmac` module).

    client → hello(v, role, nonce_c, id)
    server → challenge(nonce_s, mac_s = HMAC(key, "kvhal-p2p server" ‖ nonce_c ‖ nonce_s))
    client   checks mac_s (the server knows the key), then
    client → auth(mac_c = HMAC(key, "kvhal-p2p client" ‖ nonce_s ‖ nonce_c))
    server   checks mac_c, then → ok()

Nonces are 16 random bytes per connection (`os.urandom`), so a recorded exchange cannot be
replayed, and the two labels keep one side's proof from passing as the other's. Before `ok`,
the server serves nothing and reads nothing but these frames; a wrong proof, a malformed frame
or a missed deadline raises `AuthError` and the caller drops the connection. The key itself
never travels and never appears in a message or error.
"""
from __future__ import annotations

import hashlib
import hmac
import os
from typing import Callable

from .transport import Connection
from .wire import NONCE_BYTES, PROTOCOL_VERSION, WireError, encode

_SERVER = b"kvhal-p2p server"
_CLIENT = b"kvhal-p2p client"
ROLES = ("feed", "data")


class AuthError(Exception):
    """The peer failed the challenge or broke the handshake; args[0] says how."""


def _mac(key: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(key, label + first + second, hashlib.sha256).digest()


def client_handshake(conn: Connection, key: bytes, role: str, identity: str,
                     deadline: float) -> None:
    """Authenticate to a server and make sure it holds `key` (see module docstring).

    Args:
        role: "feed" (directory subscription) or "data" (pulls).
        identity: This instance's "host:port" (peers log it; not trusted for anything).

    Raises:
        AuthError: the server's proof is wrong or it refused ours.
        WireError, ConnectionError, TimeoutError, OSError: transport failures.
    """
    nonce_c = os.urandom(NONCE_BYTES)
    conn.send(encode("hello", v=PROTOCOL_VERSION, role=role, nonce=nonce_c, id=identity),
              deadline)
    challenge = conn.recv(deadline, "challenge")
    nonce_s = challenge["nonce"]
    if not hmac.compare_digest(challenge["mac"], _mac(key, _SERVER, nonce_c, nonce_s)):
        raise AuthError("server failed the challenge (wrong auth key?)")
    conn.send(encode("auth", mac=_mac(key, _CLIENT, nonce_s, nonce_c)), deadline)
    try:
        conn.recv(deadline, "ok")
    except ConnectionError:
        raise AuthError("server refused our proof (wrong auth key?)") from None


def server_handshake(conn: Connection, key: bytes, deadline: float,
                     heard: Callable[[], None] | None = None) -> dict:
    """Check a connecting client's proof of `key` (see module docstring).

    Args:
        heard: Called once the client's hello has passed its checks, before the challenge.

    Returns:
        The client's hello (`role`, `id`).

    Raises:
        AuthError: wrong proof, another protocol version or an unknown role.
        WireError, ConnectionError, TimeoutError, OSError: transport failures.
    """
    hello = conn.recv(deadline, "hello")
    if hello["v"] != PROTOCOL_VERSION:
        raise AuthError(f"protocol version {hello['v']} != {PROTOCOL_VERSION}")
    if hello["role"] not in ROLES:
        raise AuthError(f"unknown role {hello['role']!r}")
    if heard is not None:
        heard()
    nonce_s = os.urandom(NONCE_BYTES)
    conn.send(encode("challenge", nonce=nonce_s, mac=_mac(key, _SERVER, hello["nonce"],
                                                           nonce_s)), deadline)
    proof = conn.recv(deadline, "auth")
    if not hmac.compare_digest(proof["mac"], _mac(key, _CLIENT, nonce_s, hello["nonce"])):
        raise AuthError("client failed the challenge (wrong auth key?)")
    conn.send(encode("ok"), deadline)
    return hello


__all__ = ["AuthError", "ROLES", "WireError", "client_handshake", "server_handshake"]
