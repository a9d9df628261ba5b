"""p2p TCP transport on a real loopback connection: buffers grow with received bytes, not with a
length a peer announces."""
from __future__ import annotations

import socket
import time

import pytest

from kvhal.tiers.p2p.transport import TcpConnection
from kvhal.tiers.p2p.wire import MAX_FRAME_BYTES, encode


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """Two ends of one loopback TCP connection."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        theirs = socket.create_connection(listener.getsockname())
        ours, _ = listener.accept()
    return ours, theirs


def test_an_announced_frame_length_alone_allocates_no_frame_buffer():
    ours, theirs = tcp_pair()
    conn = TcpConnection(ours)
    try:
        theirs.sendall(MAX_FRAME_BYTES.to_bytes(4, "big") + b"x" * 100)  # then silence
        with pytest.raises(TimeoutError):
            conn.recv(time.monotonic() + 0.2)
        assert len(conn._buf) <= 128 << 10  # was the announced 1 MiB, before any handshake
    finally:
        conn.close()
        theirs.close()


def test_a_large_frame_still_arrives_whole_after_a_small_one():
    ours, theirs = tcp_pair()
    conn = TcpConnection(ours)
    big = encode("miss", why="x" * 150)
    try:
        theirs.sendall(encode("busy") + big)
        assert conn.recv(time.monotonic() + 5)["t"] == "busy"
        assert conn.recv(time.monotonic() + 5) == {"t": "miss", "why": "x" * 150}
    finally:
        conn.close()
        theirs.close()
