"""The pulling side of a p2p instance: one feed subscription per peer and pooled data links.

`FeedLink` (one thread per configured peer) connects, authenticates, installs the peer's
snapshot in the `Directory` and applies its events; on a gap it resubscribes (new
connection, fresh snapshot). When the link breaks or stays silent for `silence_s` (a peer
killed, stopped or partitioned) the peer's entries are dropped at once and the link retries
with capped exponential backoff, so a restarted peer is picked up again.

`Puller.pull` runs one load: `get` to a peer that announced the key, the payload received
straight into the reserved host slot, then the length, key and xxh3-128 digest checked before
success; `Puller.probe` asks a peer which of some keys it holds (`probe.py`). Every step is
bounded by the job's deadline. Data connections are pooled per peer
(one per pull thread at most) and closed on any error, so a failed transfer never leaves a
half-read stream behind.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

import xxhash

from kvhal.keys import ChunkKey

from .auth import AuthError, client_handshake
from .directory import Directory, Peer
from .transport import Connection, Transport, remaining
from .wire import MAX_KEYS_PER_FRAME, WireError, encode

#: Reconnect backoff of a feed link: first wait, cap (seconds).
BACKOFF_S = (0.05, 1.0)


def format_peer(peer: Peer) -> str:
    """ "host:port" ("[v6]:port" for IPv6)."""
    host, port = peer
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class FeedLink:
    """Keeps `directory` in step with one peer's feed (see module docstring).

    Args:
        count: `count(name)` bumps a tier counter ("feed_resyncs", "peer_lost", ...).
        on_lost: `on_lost(peer)` runs whenever the link to the peer is lost (the tier drops
            its pooled data connections to it).
    """

    def __init__(self, peer: Peer, transport: Transport, key: bytes, identity: str,
                 directory: Directory, *, timeout_s: float, silence_s: float,
                 count: Callable[[str], None], on_lost: Callable[[Peer], None]):
        self.peer = peer
        self._transport = transport
        self._key = key
        self._identity = identity
        self._directory = directory
        self._timeout_s = timeout_s
        self._silence_s = silence_s
        self._count = count
        self._on_lost = on_lost
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._conn: Connection | None = None
        self.synced = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvhal-p2p-feed", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        backoff = BACKOFF_S[0]
        while not self._stop.is_set():
            try:
                self._follow()
            except AuthError:
                self._count("auth_failed")
            except WireError:
                self._count("malformed")
            except (ConnectionError, TimeoutError, OSError):
                pass
            finally:
                self._disconnect()
            if self.synced.is_set():
                backoff = BACKOFF_S[0]
                self._count("peer_lost")
            self.synced.clear()
            self._directory.drop_peer(self.peer)
            self._on_lost(self.peer)
            if self._stop.wait(backoff):
                return
            backoff = min(2 * backoff, BACKOFF_S[1])

    def _follow(self) -> None:
        conn = self._transport.connect(self.peer, time.monotonic() + self._timeout_s)
        with self._lock:
            if self._stop.is_set():
                conn.close()
                return
            self._conn = conn
        client_handshake(conn, self._key, "feed", self._identity,
                         time.monotonic() + self._timeout_s)
        keys: list[ChunkKey] = []
        while True:
            snap = conn.recv(time.monotonic() + self._silence_s, "snap")
            keys += snap["keys"]
            if snap["last"]:
                break
        epoch = snap["epoch"]
        self._directory.replace(self.peer, epoch, snap["seq"], keys)
        self.synced.set()
        while not self._stop.is_set():
            msg = conn.recv(time.monotonic() + self._silence_s, "ev", "hb")
            if msg["t"] == "hb":
                in_step = self._directory.in_step(self.peer, msg["epoch"], msg["seq"])
            else:
                in_step = self._directory.apply(self.peer, msg["epoch"], msg["seq"],
                                                msg["gain"], msg["lose"])
            if not in_step:
                self._count("feed_resyncs")
                return

    def _disconnect(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def close(self) -> None:
        """Stop following, drop the connection and the peer's entries, join the thread."""
        self._stop.set()
        self._disconnect()
        self._thread.join()
        self._directory.drop_peer(self.peer)


class PullError(Exception):
    """A pull failed; args[0] is the job's error text, `why` the peer's reason of a miss
    (None if it did not answer one)."""

    def __init__(self, text: str, why: str | None = None):
        super().__init__(text)
        self.why = why


class Puller:
    """Pulls chunks from peers into host slots over pooled data connections. Thread-safe.

    Args:
        count: `count(name, n=1)` bumps a tier counter.
    """

    def __init__(self, transport: Transport, key: bytes, identity: str,
                 count: Callable[..., None]):
        self._transport = transport
        self._key = key
        self._identity = identity
        self._count = count
        self._lock = threading.Lock()
        self._idle: dict[Peer, list[Connection]] = {}
        self._busy: set[Connection] = set()
        self._closed = False

    def _take(self, peer: Peer, deadline: float) -> Connection:
        with self._lock:
            if self._closed:
                raise PullError("tier closed")
            idle = self._idle.get(peer)
            conn = idle.pop() if idle else None
            if conn is not None:
                self._busy.add(conn)
                return conn
        conn = self._transport.connect(peer, deadline)
        with self._lock:
            self._busy.add(conn)
            closed = self._closed
        if closed:
            self._drop(conn)
            raise PullError("tier closed")
        try:
            client_handshake(conn, self._key, "data", self._identity, deadline)
        except BaseException:
            self._drop(conn)
            raise
        return conn

    def _open(self, peer: Peer, deadline: float) -> Connection:
        """A data connection to `peer` (pooled, or new and authenticated).

        Raises:
            PullError: it could not be had by `deadline`; args[0] says why.
        """
        where = format_peer(peer)
        try:
            remaining(deadline)
            return self._take(peer, deadline)
        except AuthError as exc:
            self._count("auth_failed")
            raise PullError(f"peer {where}: {exc}") from None
        except TimeoutError:
            raise PullError(f"peer {where}: timed out connecting") from None
        except (ConnectionError, OSError, WireError) as exc:
            raise PullError(f"peer {where}: cannot connect ({type(exc).__name__})") from None

    def _give_back(self, peer: Peer, conn: Connection) -> None:
        with self._lock:
            self._busy.discard(conn)
            if not self._closed:
                self._idle.setdefault(peer, []).append(conn)
                return
        conn.close()

    def _drop(self, conn: Connection) -> None:
        with self._lock:
            self._busy.discard(conn)
        conn.close()

    def pull(self, peer: Peer, key: ChunkKey, out: memoryview, deadline: float,
             parked: tuple[str, float] | None = None) -> int:
        """Fill `out` with chunk `key` from `peer`, checked (see module docstring).

        Args:
            parked: (kv_request_id, wait_s) of a decode leg: ask for the chunk the prefill
                leg parks under that id, waiting up to wait_s for it (`fetch`).

        Returns:
            The generation of the parked record the chunk came from (`parking.py`; 0 for a
            pull by key).

        Raises:
            PullError: the peer does not hold it, is busy, sent another length or digest, or
                the transfer failed or passed `deadline`; args[0] says which (for the job).
        """
        where = format_peer(peer)
        conn = self._open(peer, deadline)
        try:
            conn.send(encode("get", key=key, n=len(out)) if parked is None else
                      encode("fetch", id=parked[0], key=key, n=len(out),
                             wait_ms=int(min(parked[1], remaining(deadline)) * 1e3)),
                      deadline)
            reply = conn.recv(deadline, "chunk", "miss", "busy")
            if reply["t"] != "chunk":
                self._give_back(peer, conn)
                if reply["t"] == "busy":
                    raise PullError(f"peer {where}: busy")
                raise PullError(f"peer {where}: miss ({reply['why']})", reply["why"])
            if reply["n"] != len(out) or reply["key"] != key:
                raise WireError(f"another chunk announced ({reply['n']} bytes, "
                                f"{len(out)} asked)")
            hasher = xxhash.xxh3_128()
            conn.recv_payload_into(out, deadline, hasher)
            digest = conn.recv(deadline, "end")["sum"]
        except PullError:
            raise
        except WireError as exc:
            self._count("malformed")
            self._drop(conn)
            raise PullError(f"peer {where}: malformed reply ({exc})") from None
        except TimeoutError:
            self._drop(conn)
            raise PullError(f"peer {where}: timed out") from None
        except (ConnectionError, OSError) as exc:
            self._drop(conn)
            raise PullError(f"peer {where}: connection lost ({type(exc).__name__})") from None
        self._give_back(peer, conn)
        if hasher.digest() != digest:
            self._count("checksum_mismatch")
            raise PullError(f"peer {where}: checksum mismatch")
        return reply["gen"]

    def finish(self, peer: Peer, kv_id: str, gen: int, deadline: float) -> None:
        """Tell `peer` this instance is done with the chunks parked under `kv_id` (`done`),
        having fetched last from its record of generation `gen` (0: fetched nothing; only
        that record is released, `parking.Parking.finish`).

        Raises:
            PullError: the peer could not be told by `deadline`.
        """
        conn = self._open(peer, deadline)
        try:
            conn.send(encode("done", id=kv_id, gen=gen), deadline)
            conn.recv(deadline, "ok")
        except (WireError, ConnectionError, TimeoutError, OSError) as exc:
            self._drop(conn)
            raise PullError(f"peer {format_peer(peer)}: done not delivered "
                            f"({type(exc).__name__})") from None
        self._give_back(peer, conn)

    def probe(self, peer: Peer, keys: Sequence[ChunkKey], deadline: float) -> set[ChunkKey]:
        """Which of `keys` `peer` holds now (`probe` → `held`, one round trip per
        `MAX_KEYS_PER_FRAME` keys; a key it did not ask about is ignored).

        Raises:
            PullError: the peer could not be asked by `deadline`, or answered malformed.
        """
        conn = self._open(peer, deadline)
        held: set[ChunkKey] = set()
        try:
            for i in range(0, len(keys), MAX_KEYS_PER_FRAME):
                asked = keys[i:i + MAX_KEYS_PER_FRAME]
                conn.send(encode("probe", keys=asked), deadline)
                held.update(set(conn.recv(deadline, "held")["keys"]).intersection(asked))
        except (WireError, ConnectionError, TimeoutError, OSError) as exc:
            if isinstance(exc, WireError):
                self._count("malformed")
            self._drop(conn)
            raise PullError(f"peer {format_peer(peer)}: probe not answered "
                            f"({type(exc).__name__})") from None
        self._give_back(peer, conn)
        return held

    def forget_peer(self, peer: Peer) -> None:
        """Close the idle data connections to `peer` (its feed link was lost: they are most
        likely dead, and a restarted peer needs new ones)."""
        with self._lock:
            conns = self._idle.pop(peer, [])
        for conn in conns:
            conn.close()

    def connections(self) -> int:
        """Data connections open now (idle and busy)."""
        with self._lock:
            return len(self._busy) + sum(len(v) for v in self._idle.values())

    def close(self) -> None:
        """Close every connection; pulls in flight fail at once. Idempotent."""
        with self._lock:
            self._closed = True
            conns = [c for v in self._idle.values() for c in v] + list(self._busy)
            self._idle.clear()
        for conn in conns:
            conn.close()
