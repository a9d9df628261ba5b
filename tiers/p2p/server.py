"""The serving side of a p2p instance: one listener, one thread per authenticated connection.

A connection first passes the HMAC challenge (`auth.py`) within `timeout_s`, at most
`HANDSHAKE_S`; until then it is served nothing. At most `MAX_HANDSHAKING` connections are in
the handshake at once: a new one over that drops the oldest of them that has not sent a valid
hello yet, or else the oldest (counted `handshakes_dropped`; a missed handshake deadline counts
`handshake_timeouts`). So clients that connect and stay silent hold at most that many
connections and threads, each for at most `HANDSHAKE_S`: they can neither fill the
`MAX_CONNECTIONS` of authenticated peers nor drop a connecting peer once its hello is read,
however fast they keep coming. Clients that each send a hello cannot be told from a peer
before their proof: `MAX_HANDSHAKING` of them arriving within one handshake of a peer drop it
(it retries). Then by its role:
- "feed": the feed's snapshot in pages (`snap`, the last with `last=True`), then every event
  (`ev`) as it happens, and a heartbeat (`hb`, with the last event number) whenever
  `heartbeat_s` passes without one, so the subscriber notices a silent or lost peer and any
  gap at the tail.
- "data": a loop of `get(key, n)` → `chunk(key, n, 0)` + n raw payload bytes + `end(sum)`,
  or `miss(why)`, or `busy` (more than `max_inflight` transfers in progress). A decode leg's
  `fetch(id, key, n, wait_ms)` first waits (at most `wait_ms`) until the prefill leg parked
  the chunk under `id` (`parking.py`), then is answered as a `get` whose `chunk` carries the
  parked record's generation, or `miss(why)` at once when the id or the chunk is refused;
  `done(id, gen)` (the decoder is finished with `id`, having fetched last from generation
  `gen`, 0 if none: that record's parked chunks are released) is answered `ok`; `probe(keys)`
  is answered `held(keys)` with those of them the source holds now (readable; nothing pinned:
  `probe.py`). The chunk is held
  (`Source.acquire`: host slot pinned) for the whole transfer and released after it; `sum` is
  the xxh3-128 digest the bytes had when stored (own store: bytes damaged since then fail the
  puller's check), or the digest of the pinned host slot taken at its first serve
  (`source.HostSource`: its bytes cannot change while the key stays resident). The three go out as one write (`Connection.send_parts`).
Anything unexpected (malformed frame, wrong key, deadline, reset) drops that connection only
and bumps a counter; the listener and every other connection carry on. `close` stops the
listener, closes every connection and joins every thread.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Protocol

from kvhal.keys import ChunkKey

from .auth import AuthError, server_handshake
from .parking import HELD, Parking
from .source import Feed, Served
from .transport import Connection, Transport
from .wire import MAX_KEYS_PER_FRAME, WireError, encode

#: Seconds an idle data connection is kept open waiting for its next request.
IDLE_S = 60.0
#: Connections served at once; further ones are closed at accept.
MAX_CONNECTIONS = 256
#: Connections in the HMAC handshake at once; a new one over it drops the oldest of them.
MAX_HANDSHAKING = 16
#: Longest handshake (seconds; shorter if `timeout_s` is): two round trips and two HMACs.
HANDSHAKE_S = 2.0


class Source(Protocol):
    """Where served chunks come from (`source.HostSource` or `source.OwnStore`)."""

    def acquire(self, key: ChunkKey) -> Served | None: ...

    def hold(self, key: ChunkKey) -> Callable[[], None] | None: ...


class Server:
    """Serves `feed` and `source` to authenticated peers (see module docstring).

    Args:
        transport: Makes the listener.
        host, port: Where to listen (port 0: ephemeral; see `address`).
        key: The shared auth key.
        feed, source: What to serve (`source` may be replaced later: the `source` attribute).
        timeout_s: Deadline of each transfer and (at most `HANDSHAKE_S`) of a handshake.
        heartbeat_s: Longest silence on a feed connection.
        max_inflight: Transfers served at once.
        count: `count(name)` bumps a tier counter (e.g. "auth_failed").
        parking: The prefill legs' parked chunks `fetch` and `done` address.

    Raises:
        OSError: the listener cannot bind.
    """

    def __init__(self, transport: Transport, host: str, port: int, key: bytes, feed: Feed,
                 source: Source, *, timeout_s: float, heartbeat_s: float, max_inflight: int,
                 count: Callable[[str], None], parking: Parking):
        self._listener = transport.listen(host, port)
        self.address = self._listener.address
        self._key = key
        self._feed = feed
        self.source = source
        self._parking = parking
        self._timeout_s = timeout_s
        self._heartbeat_s = heartbeat_s
        self._slots = threading.BoundedSemaphore(max_inflight)
        self._count = count
        self._lock = threading.Lock()
        self._conns: dict[Connection, threading.Thread] = {}
        self._handshaking: dict[Connection, bool] = {}  # -> hello heard; oldest first
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept_loop, name="kvhal-p2p-accept",
                                          daemon=True)
        self._acceptor.start()

    @property
    def connections(self) -> int:
        """Connections being served now."""
        with self._lock:
            return len(self._conns)

    def _accept_loop(self) -> None:
        while (conn := self._listener.accept()) is not None:
            dropped = None
            with self._lock:
                if self._closed or len(self._conns) >= MAX_CONNECTIONS:
                    conn.close()
                    self._count("connections_refused")
                    continue
                if len(self._handshaking) >= MAX_HANDSHAKING:
                    dropped = next((c for c, heard in self._handshaking.items() if not heard),
                                   next(iter(self._handshaking)))
                    del self._handshaking[dropped]
                self._handshaking[conn] = False
                thread = threading.Thread(target=self._serve, args=(conn,),
                                          name="kvhal-p2p-serve", daemon=True)
                self._conns[conn] = thread
            if dropped is not None:
                dropped.close()  # its thread's pending recv fails and the thread ends
                self._count("handshakes_dropped")
            thread.start()

    def _handshake(self, conn: Connection) -> dict:
        deadline = time.monotonic() + min(self._timeout_s, HANDSHAKE_S)
        try:
            return server_handshake(conn, self._key, deadline, lambda: self._heard(conn))
        except TimeoutError:
            self._count("handshake_timeouts")
            raise
        finally:
            with self._lock:
                self._handshaking.pop(conn, None)

    def _heard(self, conn: Connection) -> None:
        with self._lock:
            if conn in self._handshaking:   # not dropped meanwhile
                self._handshaking[conn] = True

    def _serve(self, conn: Connection) -> None:
        try:
            hello = self._handshake(conn)
            if hello["role"] == "feed":
                self._serve_feed(conn)
            else:
                self._serve_data(conn)
        except AuthError:
            self._count("auth_failed")
        except WireError:
            self._count("malformed")
        except (ConnectionError, TimeoutError, OSError):
            pass  # the peer went away or stalled; its side counts and reconnects
        finally:
            conn.close()
            with self._lock:
                self._conns.pop(conn, None)

    def _serve_feed(self, conn: Connection) -> None:
        feed, epoch = self._feed, self._feed.epoch
        seq, keys = feed.snapshot()
        deadline = lambda: time.monotonic() + self._timeout_s  # noqa: E731
        for i in range(0, max(len(keys), 1), MAX_KEYS_PER_FRAME):
            conn.send(encode("snap", epoch=epoch, seq=seq, keys=keys[i:i + MAX_KEYS_PER_FRAME],
                             last=i + MAX_KEYS_PER_FRAME >= len(keys)), deadline())
        while not self._closed:
            events = feed.events_after(seq, self._heartbeat_s)
            if events is None:
                return
            if not events:
                conn.send(encode("hb", epoch=epoch, seq=seq), deadline())
                continue
            conn.send(b"".join(encode("ev", epoch=epoch, seq=s, gain=g, lose=lo)
                               for s, g, lo in events), deadline())
            seq = events[-1][0]

    def _serve_data(self, conn: Connection) -> None:
        while not self._closed:
            request = conn.recv(time.monotonic() + IDLE_S, "get", "fetch", "done", "probe")
            if request["t"] == "probe":
                held = [key for key in request["keys"] if self._holds(key)]
                self._count("probes_served")
                conn.send(encode("held", keys=held), time.monotonic() + self._timeout_s)
                continue
            if request["t"] == "done":
                self._parking.finish(request["id"], request["gen"])
                conn.send(encode("ok"), time.monotonic() + self._timeout_s)
                continue
            gen = 0
            if request["t"] == "fetch":
                status, gen = self._parking.wait(request["id"], request["key"],
                                                 time.monotonic() + request["wait_ms"] / 1e3,
                                                 alive=lambda: not conn.peer_closed())
                if status != HELD:
                    self._count("fetch_refused")
                    conn.send(encode("miss", why=status),
                              time.monotonic() + self._timeout_s)
                    continue
            deadline = time.monotonic() + self._timeout_s
            if not self._slots.acquire(blocking=False):
                self._count("serve_busy")
                conn.send(encode("busy"), deadline)
                continue
            try:
                sent = self._serve_chunk(conn, request["key"], request["n"], deadline, gen)
            finally:
                self._slots.release()
            if sent and request["t"] == "fetch":
                self._parking.fetched(request["id"], request["key"], gen)

    def _holds(self, key: ChunkKey) -> bool:
        """Whether the source holds `key` readable now (held and let go at once)."""
        release = self.source.hold(key)
        if release is None:
            return False
        release()
        return True

    def _serve_chunk(self, conn: Connection, key: ChunkKey, nbytes: int,
                     deadline: float, gen: int) -> bool:
        """Send `key` (held for the transfer; `gen`: the parked record's generation a fetch
        is served from, 0 for a get) or a miss; True if the chunk was sent."""
        served = self.source.acquire(key)
        if served is None:
            self._count("serve_missing")
            conn.send(encode("miss", why="not held"), deadline)
            return False
        try:
            if len(served.payload) != nbytes:
                conn.send(encode("miss", why=f"holds {len(served.payload)} bytes"), deadline)
                return False
            conn.send_parts((encode("chunk", key=key, n=nbytes, gen=gen), served.payload,
                             encode("end", sum=served.checksum)), deadline)
            self._count("chunks_served")
            return True
        finally:
            served.release()

    def close(self) -> None:
        """Stop listening, drop every connection, join every thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._listener.close()
        self._acceptor.join()
        with self._lock:
            conns = dict(self._conns)
        for conn in conns:
            conn.close()
        for thread in conns.values():
            thread.join()
