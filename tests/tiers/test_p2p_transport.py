"""p2p TCP transport on a real loopback connection: buffers grow with received bytes, not with a
length a peer announces, and a frame larger than the initial buffer arrives whole however it is
split; a frame of exactly `MAX_FRAME_BYTES` is read whole, one byte more is refused at its
length prefix."""
from __future__ import annotations

import fcntl
import socket
import struct
import termios
import threading
import time

import pytest

from kvhal.tiers.p2p.transport import _READ_BYTES, TcpConnection
from kvhal.tiers.p2p.wire import LENGTH, MAX_FRAME_BYTES, MAX_KEYS_PER_FRAME, WireError, encode

from .helpers import NAMESPACE, chunk_key, wait_for


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


def _queued(sock: socket.socket, request: int) -> int:
    """Bytes in `sock`'s kernel receive queue (FIONREAD) or not yet acknowledged by the other
    end (TIOCOUTQ)."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), request, b"\0" * 4))[0]


def _send_in_pieces(sock: socket.socket, receiver: socket.socket, data: bytes,
                    cuts: list[int]) -> threading.Thread:
    """Send `data` cut at `cuts`, each piece only once the one before was acknowledged and
    read out of `receiver`'s kernel queue, so the receiving `TcpConnection` takes each piece in
    its own reads, whatever the machine's load."""
    def run():
        for start, end in zip([0] + cuts, cuts + [len(data)]):
            sock.sendall(data[start:end])
            wait_for(lambda: _queued(sock, termios.TIOCOUTQ) == 0, what="piece acknowledged")
            wait_for(lambda: _queued(receiver, termios.FIONREAD) == 0, what="piece read")
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_frame_larger_than_the_buffer_arrives_whole_across_many_sends():
    """A full feed page (`MAX_KEYS_PER_FRAME` keys, several times the initial `_READ_BYTES`
    buffer), sent in pieces after a small frame and followed by another: the buffer moves the
    unconsumed bytes to its front and grows piece by piece. Fails when the buffer stops growing
    (e.g. without `TcpConnection._make_room`'s `if len(self._buf) < n` block: a read into no
    room) or loses bytes as it moves or grows them (e.g. without its first block)."""
    ours, theirs = tcp_pair()
    conn = TcpConnection(ours)
    keys = [chunk_key(NAMESPACE, i) for i in range(MAX_KEYS_PER_FRAME)]
    page = encode("snap", epoch=bytes(16), seq=7, keys=keys, last=False)
    data = encode("busy") + page + encode("hb", epoch=bytes(16), seq=7)
    assert len(page) > 3 * _READ_BYTES
    cuts = [len(encode("busy")) + 100] + list(range(40 << 10, len(data) - 10, 40 << 10))
    sender = _send_in_pieces(theirs, ours, data, cuts)
    try:
        received = [conn.recv(time.monotonic() + 20) for _ in range(3)]
        sender.join(20)
    finally:
        conn.close()
        theirs.close()

    assert received == [{"t": "busy"},
                        {"t": "snap", "epoch": bytes(16), "seq": 7, "keys": keys, "last": False},
                        {"t": "hb", "epoch": bytes(16), "seq": 7}]


def _frame_of(nbytes: int) -> bytes:
    """An encoded `miss` frame whose body is exactly `nbytes` long (`why` padded)."""
    overhead = len(encode("miss", why="x" * (1 << 17))) - 4 - (1 << 17)
    return encode("miss", why="x" * (nbytes - overhead))


def test_a_frame_of_exactly_max_frame_bytes_is_read_whole_and_one_more_refused_at_its_prefix():
    """`wire.encode` makes a frame of exactly `MAX_FRAME_BYTES` and refuses one byte more;
    the body of the first is read whole and judged by its content (its `why` is far over the
    schema's cap: undecodable); a prefix announcing one byte more is refused as it arrives,
    without waiting for a body. Fails when the bound is off by one either way in
    `wire.frame_length` (`<` for `<=`: the first frame is refused by its length;
    `<= MAX_FRAME_BYTES + 1`: the second waits for its body and times out) or in `encode`."""
    frame = _frame_of(MAX_FRAME_BYTES)
    with pytest.raises(WireError) as too_long:
        _frame_of(MAX_FRAME_BYTES + 1)
    ours, theirs = tcp_pair()
    conn = TcpConnection(ours)
    sender = threading.Thread(target=theirs.sendall, args=(frame,), daemon=True)
    sender.start()
    try:
        with pytest.raises(WireError) as whole:
            conn.recv(time.monotonic() + 20)
        sender.join(20)
    finally:
        conn.close()
        theirs.close()
    ours, theirs = tcp_pair()
    conn = TcpConnection(ours)
    try:
        theirs.sendall(LENGTH.pack(MAX_FRAME_BYTES + 1))   # and no body
        with pytest.raises(WireError) as prefix:
            conn.recv(time.monotonic() + 2)
    finally:
        conn.close()
        theirs.close()

    assert len(frame) == 4 + MAX_FRAME_BYTES
    assert str(too_long.value) == f"frame of {MAX_FRAME_BYTES + 1} bytes exceeds {MAX_FRAME_BYTES}"
    assert str(whole.value) == "undecodable frame (ValueError)"
    assert str(prefix.value) == f"frame length {MAX_FRAME_BYTES + 1} outside 1..{MAX_FRAME_BYTES}"
