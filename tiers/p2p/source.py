"""What an instance serves to its peers: the feed of its gains and losses, and the chunk bytes.

`Feed` holds the set of keys this instance serves and numbers every change (epoch, seq) for
subscribers (`server.py` sends it; `directory.py` applies it). Two sources fill it:

- `HostSource` (a tier attached to the engine's host tier): serves straight from host slots.
  `acquire` pins the slot through `HostAccess.pin`, so the manager neither evicts nor rewrites
  it until the transfer ends; the feed follows the host tier's gains and losses as the engine
  reports them. No copy. The host tier keeps no digest of its slots (hashing every offloaded
  chunk would tax the store path for chunks no peer pulls), so the first serve of a resident
  chunk takes its xxh3-128 over the pinned bytes and remembers it by (key, slot offset) until
  the host tier loses the key: repeated pulls of a popular prefix hash it once
  (`kvhal bench p2p`, 2 MiB chunks on this loaded machine: 0.23 ms per digest, against
  0.83 ms of serving CPU per chunk and a 7-8 ms pull p50 with 4 pulls in flight). A digest taken while any loss was announced is not
  remembered, so a rewritten slot is never served with an old digest; and the puller checks
  the bytes it received against the digest in any case.
- `OwnStore` (a tier without a host tier, e.g. under the conformance suite or a bench): a
  store job copies the slot into an immutable `bytes` of the tier's own (LRU, `max_bytes`),
  with its xxh3-128 digest taken at store time; a serve in flight keeps its `bytes` alive
  even if the chunk is evicted meanwhile.
"""
from __future__ import annotations

import collections
import os
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

from kvhal.keys import ChunkKey

from kvhal.tier import HostAccess
from ..chunk_format import payload_checksum
from ..index import ChunkIndex, StoresInFlight
from .wire import EPOCH_BYTES, MAX_KEYS_PER_FRAME

#: Events a feed keeps for subscribers that fell behind; one further back must resync.
FEED_BACKLOG = 4096
#: Keys a source remembers for `take_removed` between calls.
MAX_REMEMBERED_REMOVALS = 1 << 16

Event = tuple[int, tuple[ChunkKey, ...], tuple[ChunkKey, ...]]  # (seq, gained, lost)
Listener = Callable[[bytes, int, Sequence[ChunkKey], Sequence[ChunkKey]], None]


class Feed:
    """The served key set and its numbered changes. Thread-safe.

    Attributes:
        epoch: 16 random bytes drawn at construction; a restarted instance is a new epoch.
    """

    def __init__(self) -> None:
        self.epoch = os.urandom(EPOCH_BYTES)
        self._cond = threading.Condition()
        self._seq = 0
        self._keys: set[ChunkKey] = set()
        self._log: collections.deque[Event] = collections.deque(maxlen=FEED_BACKLOG)
        self._listeners: list[Listener] = []
        self._closed = False

    def publish(self, gained: Sequence[ChunkKey], lost: Sequence[ChunkKey]) -> None:
        """Record a change (one event per `MAX_KEYS_PER_FRAME` keys) and wake subscribers."""
        with self._cond:
            step = MAX_KEYS_PER_FRAME // 2
            for i in range(0, max(len(gained), len(lost)), step):
                g, lo = tuple(gained[i:i + step]), tuple(lost[i:i + step])
                self._keys.difference_update(lo)
                self._keys.update(g)
                self._seq += 1
                self._log.append((self._seq, g, lo))
                for listener in self._listeners:
                    listener(self.epoch, self._seq, g, lo)
            self._cond.notify_all()

    def snapshot(self) -> tuple[int, list[ChunkKey]]:
        """(seq of the last event included, served keys)."""
        with self._cond:
            return self._seq, list(self._keys)

    def listen(self, listener: Listener) -> tuple[int, list[ChunkKey]]:
        """Call `listener(epoch, seq, gained, lost)` for every later event (under the feed's
        lock: it must be quick); returns the snapshot it starts after."""
        with self._cond:
            self._listeners.append(listener)
            return self._seq, list(self._keys)

    def events_after(self, seq: int, timeout_s: float) -> list[Event] | None:
        """Events after `seq`, waiting up to `timeout_s` for one; [] if none came, None once
        closed. If the backlog no longer reaches back to seq + 1 the first event returned
        has a larger number (the subscriber sees the gap and resyncs)."""
        with self._cond:
            self._cond.wait_for(lambda: self._seq > seq or self._closed, timeout_s)
            if self._closed:
                return None
            return [e for e in self._log if e[0] > seq] if self._seq > seq else []

    @property
    def seq(self) -> int:
        """Number of the last event."""
        with self._cond:
            return self._seq

    def close(self) -> None:
        """Wake every waiting subscriber for good."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


@dataclass(frozen=True, slots=True)
class Served:
    """A chunk held for one transfer. Call `release` exactly once when done.

    Attributes:
        payload: The chunk's bytes (a view of the pinned host slot or of the own copy).
        checksum: xxh3-128 digest of the bytes: taken when they were stored (own store), or
            over the pinned, unchanging slot at its first serve (host slots).
    """

    payload: memoryview
    checksum: bytes
    release: Callable[[], None]


def _noop() -> None:
    return None


class _Removals:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gone: collections.deque[ChunkKey] = collections.deque(
            maxlen=MAX_REMEMBERED_REMOVALS)

    def add(self, keys: Sequence[ChunkKey]) -> None:
        with self._lock:
            self._gone.extend(keys)

    def take(self) -> list[ChunkKey]:
        with self._lock:
            out = list(self._gone)
            self._gone.clear()
            return out


class HostSource:
    """Serves the host tier's resident chunks from their slots (see module docstring).

    Args:
        count: `count(name)` bumps a tier counter ("serve_digests": digests taken).
    """

    def __init__(self, access: HostAccess, host: memoryview, feed: Feed,
                 count: Callable[[str], None]):
        self._access = access
        self._host = host
        self._feed = feed
        self._count = count
        self._removals = _Removals()
        self._lock = threading.Lock()
        self._digests: dict[ChunkKey, tuple[int, bytes]] = {}  # key -> (slot offset, xxh3)
        self._losses = 0  # announcements of lost keys so far
        feed.publish(access.subscribe(self._changed), ())

    def _changed(self, gained: Sequence[ChunkKey], lost: Sequence[ChunkKey]) -> None:
        self._feed.publish(gained, lost)
        if lost:
            self._removals.add(lost)
            with self._lock:
                self._losses += 1
                for key in lost:
                    self._digests.pop(key, None)

    def acquire(self, key: ChunkKey) -> Served | None:
        """Pin `key`'s slot for one transfer, or None if it is not resident and idle."""
        with self._lock:
            losses = self._losses  # read before the pin: a loss after it voids the digest
        offset = self._access.pin(key)
        if offset is None:
            return None
        payload = self._host[offset:offset + self._access.chunk_nbytes]
        with self._lock:
            held = self._digests.get(key)
        if held is not None and held[0] == offset:
            digest = held[1]
        else:
            digest = payload_checksum(payload)
            self._count("serve_digests")
            with self._lock:
                if self._losses == losses:
                    self._digests[key] = (offset, digest)
        return Served(payload, digest, lambda: self._access.unpin(offset))

    def hold(self, key: ChunkKey) -> Callable[[], None] | None:
        """Pin `key`'s slot for as long as a prefill leg parks it (`parking.py`); returns
        the unpin, or None if the chunk is not resident and readable."""
        offset = self._access.pin(key)
        return None if offset is None else lambda: self._access.unpin(offset)

    def take_removed(self) -> list[ChunkKey]:
        """Keys the host tier lost since the last call."""
        return self._removals.take()


class OwnStore:
    """The tier's own LRU copy of stored chunks (see module docstring). Thread-safe.

    Args:
        max_bytes: Most payload bytes held.
        feed: The feed its gains and losses are announced on.
        count: `count(name, n)` bumps a tier counter ("bytes_stored", "already_stored").
    """

    def __init__(self, max_bytes: int, feed: Feed, count: Callable[[str, int], None]):
        self.max_bytes = max_bytes
        self._feed = feed
        self._count = count
        self._lock = threading.Lock()
        self._data: dict[ChunkKey, tuple[bytes, bytes]] = {}
        self._index = ChunkIndex()

    def __len__(self) -> int:
        return len(self._index)

    @property
    def used_bytes(self) -> int:
        """Bytes held (plus stores in flight)."""
        return self._index.used_bytes

    def put(self, key: ChunkKey, payload: memoryview) -> str | None:
        """Copy `payload` in as `key` (evicting least recently used chunks; counted as
        bytes_stored); an existing key keeps its first bytes (counted as already_stored),
        unless it was forgotten since (`forget`). Returns None, or why not (larger than
        `max_bytes`, or puts in flight hold the room)."""
        if self._index.skip_store(key):
            self._count("already_stored", 1)
            return None
        nbytes = len(payload)
        try:
            victims = self._index.reserve(nbytes, self.max_bytes)
        except StoresInFlight as exc:
            return f"chunk: {exc}"
        if victims is None:
            return f"chunk of {nbytes} bytes exceeds max_bytes {self.max_bytes}"
        stored = None
        try:
            data = bytes(payload)
            checksum = payload_checksum(data)
            with self._lock:
                for victim, _ in victims:
                    self._data.pop(victim, None)
                self._data[key] = (data, checksum)
            stored = key
        finally:
            self._index.release(nbytes, stored)      # indexed as the reservation ends
        self._feed.publish([key], [v for v, _ in victims])
        self._count("bytes_stored", nbytes)
        return None

    def forget(self, keys: Sequence[ChunkKey]) -> None:
        """Drop `keys`: a pull from this instance found `keys[0]` no longer held whole, and
        the later chunks of its prefix are in doubt too (`SecondaryTier.forget`). Their bytes
        go, peers hear of their loss, and the next `put` of each copies it in anew."""
        self._index.forget(keys)
        with self._lock:
            for key in keys:
                self._data.pop(key, None)
        self._feed.publish([], list(keys))

    def acquire(self, key: ChunkKey) -> Served | None:
        """The stored bytes of `key` (most recently used now), or None."""
        with self._lock:
            held = self._data.get(key)
        if held is None:
            return None
        self._index.touch(key)
        return Served(memoryview(held[0]), held[1], _noop)

    def hold(self, key: ChunkKey) -> Callable[[], None] | None:
        """A no-op release if `key` is held now, else None: the own store is an LRU without
        pins, so a parked chunk evicted later is a miss for its decoder."""
        with self._lock:
            return _noop if key in self._data else None

    def take_removed(self) -> list[ChunkKey]:
        """Keys evicted since the last call."""
        return self._index.take_removed()
