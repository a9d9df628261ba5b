"""p2p authentication seen from the serving side: a client that skips its own checks (ignores
the server's proof, sends a wrong, reflected or replayed proof, another protocol version or an
unknown role) is refused by the server itself: the connection closes, no `ok`, `chunk`, `snap`
or `ev` frame comes back, one `auth_failed` is counted and no chunk is served.

The wrong-key tests of `test_p2p_tier.py` stop at the *client's* check of the server's proof;
these exercise the server's check of the client's proof, the one that guards the chunks."""
from __future__ import annotations

import os
import socket
import time

import pytest
from kvhal.tiers.p2p.auth import _CLIENT, _mac, client_handshake
from kvhal.tiers.p2p.transport import TcpConnection
from kvhal.tiers.p2p.wire import NONCE_BYTES, PROTOCOL_VERSION, encode

from .helpers import NAMESPACE, chunk_key, wait_for
from .p2p_helpers import KEY, serving_tier

#: Seconds a test waits for the server to answer or close (it closes in milliseconds).
REPLY_S = 5.0
GET = encode("get", key=chunk_key(NAMESPACE, 0), n=4096)
#: A P/D decoder's "finished with this kv_request_id" (releases the prefiller's parked chunks).
DONE = encode("done", id="request-1", gen=0)
#: Frames that only an authenticated client gets: a chunk, a feed page or event.
SERVICE = ("chunk", "snap", "ev")


@pytest.fixture
def server():
    """A p2p tier in this process serving chunk 0 (4096 bytes) from its own store."""
    yield from serving_tier()


class FaultyClient:
    """A p2p client on a real TCP connection that speaks the real codec (`wire.encode`,
    `TcpConnection`) but skips the checks of `auth.client_handshake`: it ignores the server's
    proof and sends whatever hello and proof the test hands it. Injects the handshakes of a
    misconfigured or hostile client, which a real client never sends."""

    def __init__(self, address: tuple[str, int]):
        self.conn = TcpConnection(socket.create_connection(address, timeout=REPLY_S))
        self.nonce = os.urandom(NONCE_BYTES)

    def hello(self, role: str, v: int = PROTOCOL_VERSION) -> None:
        """Send a hello with this client's nonce."""
        self.send(encode("hello", v=v, role=role, nonce=self.nonce, id="faulty:1"))

    def send(self, frame: bytes) -> None:
        """Send raw encoded frames."""
        self.conn.send(frame, time.monotonic() + REPLY_S)

    def challenge(self) -> dict:
        """The server's challenge (its nonce and proof, which this client does not check)."""
        return self.conn.recv(time.monotonic() + REPLY_S, "challenge")

    def proof(self, key: bytes, challenge: dict) -> bytes:
        """The client proof of `key` for this connection (computed by `auth`'s own HMAC)."""
        return _mac(key, _CLIENT, challenge["nonce"], self.nonce)

    def replies(self) -> tuple[list[str], bool]:
        """Types of the frames the server sends from now on, and whether it closed the
        connection (False: still open after `REPLY_S`). Stops at the first `SERVICE` frame
        (a `chunk` frame's raw payload follows it)."""
        types: list[str] = []
        deadline = time.monotonic() + REPLY_S
        try:
            while not types or types[-1] not in SERVICE:
                types.append(self.conn.recv(deadline)["t"])
        except ConnectionError:   # closed or reset: the server dropped us
            return types, True
        except TimeoutError:
            return types, False
        return types, False

    def close(self) -> None:
        self.conn.close()


@pytest.fixture
def clients(server):
    opened: list[FaultyClient] = []

    def connect() -> FaultyClient:
        opened.append(FaultyClient(server._server.address))
        return opened[-1]
    yield connect
    for c in opened:
        c.close()


def _refused(server, replies) -> None:
    """The server closed the connection having sent nothing, counted one auth failure and
    served no chunk; the connection's thread is gone."""
    assert replies == ([], True)
    stats = server.stats()
    assert (stats.get("auth_failed", 0), stats.get("chunks_served", 0),
            stats.get("malformed", 0)) == (1, 0, 0)
    refused = server.metrics["handshakes_refused"].series()
    assert {k: c.read() for k, c in refused.items() if c.read()} == {("auth_failed",): 1}
    wait_for(lambda: server.stats()["connections"] == 0, REPLY_S, "connection closed")


@pytest.mark.parametrize("role,expected", [("data", ["ok", "chunk"]), ("feed", ["ok", "snap"])])
def test_the_faulty_client_with_the_right_proof_is_served(server, clients, role, expected):
    """Control of the tests below: the same client with the shared key's proof gets `ok` and
    then the chunk or the feed, so their refusals are the proof's doing, not the client's."""
    client = clients()
    client.hello(role)
    challenge = client.challenge()
    client.send(encode("auth", mac=client.proof(KEY.encode(), challenge))
                + (GET if role == "data" else b""))

    types, closed = client.replies()

    assert (types[:2], closed) == (expected, False)
    assert server.stats().get("auth_failed", 0) == 0


@pytest.mark.parametrize("role,request_", [("data", GET), ("data", DONE), ("feed", b"")],
                         ids=["data-get", "data-done", "feed"])
@pytest.mark.parametrize("wrong", ["another key", "zeros", "server's proof reflected"])
def test_a_wrong_proof_gets_nothing_and_is_counted(server, clients, role, request_, wrong):
    """Fails when the server's check of the client's proof goes (e.g. with the
    `hmac.compare_digest` of `auth.server_handshake` removed: `ok` and the chunk, the `ok` of
    a `done` that releases a decoder's parked chunks, or the snapshot come back). The data
    client sends its request right after its proof, the feed client waits for the snapshot."""
    client = clients()
    client.hello(role)
    challenge = client.challenge()
    mac = {"another key": client.proof(b"another-key-another-key", challenge),
           "zeros": bytes(32), "server's proof reflected": challenge["mac"]}[wrong]
    client.send(encode("auth", mac=mac) + request_)

    _refused(server, client.replies())


class RecordingConnection(TcpConnection):
    """A `TcpConnection` that keeps a copy of every frame it sends (for a replay)."""

    def __init__(self, sock: socket.socket):
        super().__init__(sock)
        self.sent: list[bytes] = []

    def send(self, frame: bytes, deadline: float) -> None:
        self.sent.append(frame)
        super().send(frame, deadline)


def test_a_recorded_handshake_replayed_on_a_new_connection_is_refused(server, clients):
    """Fails when the server's check of the client's proof goes (as above) or when its nonce
    stops being fresh per connection (e.g. `nonce_s = bytes(NONCE_BYTES)` in
    `auth.server_handshake`: the recorded proof then passes again)."""
    recorded = RecordingConnection(socket.create_connection(server._server.address, REPLY_S))
    try:
        client_handshake(recorded, KEY.encode(), "data", "recorded:1",
                         time.monotonic() + REPLY_S)
        recorded.send(GET, time.monotonic() + REPLY_S)
        assert recorded.recv(time.monotonic() + REPLY_S, "chunk")["n"] == 4096  # it was good
    finally:
        recorded.close()
    wait_for(lambda: server.stats().get("chunks_served") == 1, REPLY_S, "the recorded get")
    hello, auth = recorded.sent[:2]
    replay = clients()

    replay.send(hello)           # the same client nonce as the recorded connection
    replay.challenge()           # a fresh server nonce
    replay.send(auth + GET)      # the recorded proof, for the old server nonce

    assert replay.replies() == ([], True)
    stats = server.stats()
    assert (stats.get("auth_failed", 0), stats["chunks_served"]) == (1, 1)  # the recorded get


@pytest.mark.parametrize("role,v", [("data", PROTOCOL_VERSION + 1), ("data", 0),
                                    ("admin", PROTOCOL_VERSION), ("", PROTOCOL_VERSION)],
                         ids=["next version", "version 0", "role admin", "empty role"])
def test_another_version_or_an_unknown_role_is_refused_before_the_challenge(server, clients,
                                                                             role, v):
    """Fails when `auth.server_handshake` stops checking the hello's version or role (e.g.
    with `if hello["v"] != PROTOCOL_VERSION` removed: a challenge comes back)."""
    client = clients()

    client.hello(role, v)

    _refused(server, client.replies())
