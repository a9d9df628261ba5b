"""A real S3 server for the obj tier's tests, and a fault-injecting proxy in front of it.

`shared_server()` starts one `moto_server` process per test process (lazily, on a free
127.0.0.1 port; killed at exit) with the bucket `BUCKET`; the `s3_server` fixture hands it to
tests in `tests/` and `conformance/`, and the obj conformance harness uses it directly so
`pytest conformance/ --kvhal-tier=obj` needs nothing else.

`FaultyS3Proxy` is a small HTTP/1.1 proxy on loopback that forwards to the real server and,
on demand, answers matching requests with an S3 error status (5xx, 503 SlowDown, 403, 404,
507), stops answering (the connection stays open, nothing comes back), cuts a response off
mid-body (a server dying mid-transfer), cuts a request body off mid-upload (the server gets
half of it, the client a reset), holds responses with their first bytes delivered (so a test
knows bytes are in flight, e.g. before it kills the server behind the proxy), or refuses
connections (its port closed). A real server cannot produce these on demand; the client under
test is never patched.
"""
from __future__ import annotations

import atexit
import dataclasses
import socket
import struct
import threading
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # imported on first use: `kvhal.tiers.obj` needs the `s3` extra
    from kvhal.tiers.obj.local_server import LocalS3Server

BUCKET = "kvhal-tests"
#: Static test credentials (moto accepts any by default).
ACCESS_KEY, SECRET_KEY = "AKIAKVHALTESTKEY0001", "kvhal-test-secret-key-never-printed"

_server: LocalS3Server | None = None
_lock = threading.Lock()


def shared_server() -> LocalS3Server:
    """This process's moto server (started on first use, with `BUCKET`; killed at exit).

    Raises:
        ImportError: the `s3` extra (obstore) is not installed.
    """
    from kvhal.tiers.obj.local_server import LocalS3Server
    global _server
    with _lock:
        if _server is None or not _server.running:
            _server = LocalS3Server().start()
            _server.create_bucket(BUCKET)
            atexit.register(_server.kill)
        return _server


@pytest.fixture(scope="session")
def s3_server() -> LocalS3Server:
    """The shared moto server (see `shared_server`), or a skip naming the `s3` extra."""
    pytest.importorskip("obstore", reason="the obj tier needs the s3 extra: pip install "
                                          "'kvhal[s3]'")
    return shared_server()


def store_config(endpoint: str, bucket: str = BUCKET, **extra) -> dict:
    """An obj tier `store_config` for `endpoint` with the static test credentials."""
    return {"bucket": bucket, "endpoint_override": endpoint, "access_key": ACCESS_KEY,
            "secret_key": SECRET_KEY} | extra


@dataclasses.dataclass
class Fault:
    """What `FaultyS3Proxy` does to matching requests.

    Attributes:
        kind: "status" (answer `status` with S3 error `code`), "stall" (read the request, never
            answer), "cut" (forward, then close after half the response body, or half the
            head of a response without a body), "cut-upload" (read half the request body,
            forward the head and that half, then close both connections: the client's with a
            reset), or "hold" (forward the response head and its first `hold_bytes` of body,
            then hold until `FaultyS3Proxy.release`, then stream the rest from the server as
            it comes; a server gone meanwhile closes the client's connection mid-body).
        methods: HTTP methods it applies to.
        objects_only: Apply only to object requests (not bucket LIST / bulk DELETE).
        status, code: For "status".
        hold_bytes: For "hold".
        remaining: How many more requests it applies to (None: all).
    """

    kind: str
    methods: tuple[str, ...] = ("GET", "PUT", "POST", "DELETE", "HEAD")
    objects_only: bool = True
    status: int = 503
    code: str = "SlowDown"
    hold_bytes: int = 64 << 10
    remaining: int | None = None


class FaultyS3Proxy:
    """Loopback HTTP proxy to `upstream_port` injecting `Fault`s (module docstring).

    Attributes:
        endpoint: "http://127.0.0.1:<port>" to give the tier.
        injected: Requests a fault was applied to.
        cut_uploads: Requests whose body "cut-upload" cut off (half forwarded to the server).
    """

    #: Receive buffer of each connection to the server: with the proxy not reading (a held
    #: response), the server can have at most this (doubled by Linux) plus its own send
    #: buffer (net.ipv4.tcp_wmem, 4 MiB by default) on its way.
    UPSTREAM_RCVBUF = 256 << 10

    def __init__(self, upstream_port: int):
        self._upstream = ("127.0.0.1", upstream_port)
        self._fault: Fault | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self.injected = self.cut_uploads = 0
        self._holding = 0
        self._held = threading.Condition(self._lock)
        self._released = threading.Event()
        self._listener = self._listen(0)
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._accept_thread = self._start_accepting()

    # -- control ------------------------------------------------------------------------------
    def set_fault(self, fault: Fault | None) -> None:
        """Apply `fault` to matching requests from now on (None: forward everything)."""
        with self._lock:
            self._fault = fault

    def wait_holding(self, count: int, timeout_s: float) -> None:
        """Wait until `count` responses are held by a "hold" fault (their head and first
        bytes sent to the client).

        Raises:
            TimeoutError: fewer are held after `timeout_s`.
        """
        with self._held:
            if not self._held.wait_for(lambda: self._holding >= count, timeout_s):
                raise TimeoutError(f"{self._holding} of {count} responses held "
                                   f"after {timeout_s} s")

    def release(self) -> None:
        """Let held responses (and later "hold" ones) go on."""
        self._released.set()

    def refuse(self) -> None:
        """Close the listening port and every open connection: connections are refused."""
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() of its thread
        except OSError:
            pass
        self._listener.close()
        self._accept_thread.join()
        self._drop_connections()

    def resume(self) -> None:
        """Listen again on the same port after `refuse`."""
        self._listener = self._listen(self.port)
        self._accept_thread = self._start_accepting()

    def close(self) -> None:
        """Stop listening and drop every connection."""
        self._closed.set()
        self._released.set()
        self.refuse()

    def __enter__(self) -> "FaultyS3Proxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- plumbing -----------------------------------------------------------------------------
    @staticmethod
    def _listen(port: int) -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen(64)
        return s

    def _start_accepting(self) -> threading.Thread:
        t = threading.Thread(target=self._accept_loop, args=(self._listener,), daemon=True)
        t.start()
        return t

    def _drop_connections(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, set()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            with self._lock:
                self._conns.add(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _take_fault(self, method: str, target: str) -> Fault | None:
        path, _, query = target.partition("?")
        is_object = path.strip("/").count("/") >= 1 and "list-type" not in query \
            and "delete" not in query
        with self._lock:
            f = self._fault
            if f is None or method not in f.methods or (f.objects_only and not is_object):
                return None
            if f.remaining is not None:
                if f.remaining <= 0:
                    return None
                f.remaining -= 1
            self.injected += 1
            return dataclasses.replace(f)

    def _serve(self, client: socket.socket) -> None:
        upstream = None
        reader = client.makefile("rb")
        try:
            while not self._closed.is_set():
                head = _read_head(reader)
                if head is None:
                    return
                method, target = head[0].split(b" ")[:2]
                fault = self._take_fault(method.decode(), target.decode())
                if fault is not None and fault.kind == "cut-upload":
                    upstream = self._connect()
                    self._cut_upload(reader, head, upstream, client)
                    return
                body = _read_body(reader, head)
                if body is None:  # the client went away mid-body: forward nothing
                    return
                if fault is not None and fault.kind == "status":
                    client.sendall(_error_response(fault.status, fault.code))
                    continue
                if fault is not None and fault.kind == "stall":
                    self._closed.wait()
                    return
                if upstream is None:
                    upstream = self._connect()
                    up_reader = upstream.makefile("rb")
                upstream.sendall(b"\r\n".join(head) + b"\r\n\r\n" + body)
                resp_head = _read_head(up_reader)
                if resp_head is None:
                    return
                if fault is not None and fault.kind == "hold":
                    if not self._hold(fault, resp_head, up_reader, client):
                        return
                    continue
                resp_body = b"" if method == b"HEAD" else _read_body(up_reader, resp_head)
                if resp_body is None:
                    return
                out = b"\r\n".join(resp_head) + b"\r\n\r\n"
                if fault is not None and fault.kind == "cut":
                    keep = len(out) + len(resp_body) // 2 if resp_body else len(out) // 2
                    client.sendall((out + resp_body)[:keep])
                    return
                client.sendall(out + resp_body)
        except OSError:
            return
        finally:
            for s in (client, upstream):
                if s is not None:
                    s.close()
            with self._lock:
                self._conns.discard(client)


    def _connect(self) -> socket.socket:
        """A new connection to the server, its receive buffer `UPSTREAM_RCVBUF`."""
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.UPSTREAM_RCVBUF)
        try:
            s.connect(self._upstream)
        except OSError:
            s.close()
            raise
        return s

    def _cut_upload(self, reader, head: list[bytes], upstream: socket.socket,
                    client: socket.socket) -> None:
        """Forward `head` and half of its Content-Length body, then close both connections
        (the client's with a reset: SO_LINGER 0)."""
        half = int(_header(head, b"content-length") or 0) // 2
        upstream.sendall(b"\r\n".join(head) + b"\r\n\r\n" + reader.read(half))
        with self._lock:
            self.cut_uploads += 1
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    def _hold(self, fault: Fault, resp_head: list[bytes], up_reader,
              client: socket.socket) -> bool:
        """Send the response head and its first `fault.hold_bytes`, hold until `release`,
        then stream the rest of the Content-Length body. Returns False if the server's
        connection ended before the body did (the client's connection is then to be closed)."""
        remaining = int(_header(resp_head, b"content-length") or 0)
        first = up_reader.read(min(fault.hold_bytes, remaining))
        client.sendall(b"\r\n".join(resp_head) + b"\r\n\r\n" + first)
        remaining -= len(first)
        with self._held:
            self._holding += 1
            self._held.notify_all()
        self._released.wait()
        while remaining > 0:
            piece = up_reader.read1(min(remaining, 1 << 16))
            if not piece:
                return False
            client.sendall(piece)
            remaining -= len(piece)
        return True


def _read_head(reader) -> list[bytes] | None:
    lines = []
    while True:
        line = reader.readline(65536)
        if not line:
            return None
        if line in (b"\r\n", b"\n"):
            return lines if lines else None
        lines.append(line.rstrip(b"\r\n"))


def _header(head: list[bytes], name: bytes) -> bytes | None:
    for line in head[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == name:
            return v.strip()
    return None


def _read_body(reader, head: list[bytes]) -> bytes | None:
    """The message body, re-encoded as sent (Content-Length or chunked), or None if the
    connection ended before a Content-Length body did."""
    length = _header(head, b"content-length")
    if length is not None:
        body = reader.read(int(length))
        return body if len(body) == int(length) else None
    if (_header(head, b"transfer-encoding") or b"").lower() == b"chunked":
        parts = []
        while True:
            size_line = reader.readline()
            parts.append(size_line)
            size = int(size_line.split(b";")[0], 16)
            parts.append(reader.read(size + 2))
            if size == 0:
                return b"".join(parts)
    return b""


def _error_response(status: int, code: str) -> bytes:
    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>injected by FaultyS3Proxy</Message></Error>").encode()
    return (f"HTTP/1.1 {status} Injected\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body

