"""The directory: which peer holds which chunk, fed by the peers' published gains and losses.

Each peer's feed (`server.Feed`) is a snapshot followed by events numbered 1, 2, ... within an
epoch (16 random bytes drawn when the peer starts, so a restarted peer is a new epoch). The
directory applies an event only if it is the next one of the peer's current epoch; anything
else is a gap, and the subscriber asks for a fresh snapshot, which replaces every entry of
that peer. A peer that goes away (feed connection lost, heartbeats missed) loses all its
entries. A load that finds an entry stale (the peer answered "miss", or the pull failed)
`forget`s it, and with it the peer's entries of the later chunks of the prefix, so a peer that
lost a prefix costs one failed load and then misses.

Lookups are dictionary reads under one lock: no I/O, no waiting on the network.
"""
from __future__ import annotations

import threading
from typing import Iterable

from kvhal.keys import ChunkKey

Peer = tuple[str, int]


class Directory:
    """Thread-safe map chunk key → peers that announced it. Written by feed threads, read by
    the manager's lookups and by pulls."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders: dict[ChunkKey, list[Peer]] = {}
        self._keys: dict[Peer, set[ChunkKey]] = {}
        self._position: dict[Peer, tuple[bytes, int]] = {}  # peer -> (epoch, last seq)

    def holders(self, key: ChunkKey) -> list[Peer]:
        """Peers that announced `key` (most recent announcement first); empty if none."""
        with self._lock:
            return list(self._holders.get(key, ()))

    def __contains__(self, key: ChunkKey) -> bool:
        with self._lock:
            return key in self._holders

    def count(self, peer: Peer | None = None) -> int:
        """Entries of `peer` (None: distinct keys over all peers)."""
        with self._lock:
            return len(self._holders) if peer is None else len(self._keys.get(peer, ()))

    def replace(self, peer: Peer, epoch: bytes, seq: int, keys: Iterable[ChunkKey]) -> None:
        """Install a snapshot: `peer` holds exactly `keys` as of event `seq` of `epoch`."""
        with self._lock:
            self._drop(peer)
            held = self._keys[peer] = set()
            for key in keys:
                self._add(peer, key, held)
            self._position[peer] = (epoch, seq)

    def apply(self, peer: Peer, epoch: bytes, seq: int, gained: Iterable[ChunkKey],
              lost: Iterable[ChunkKey]) -> bool:
        """Apply event `seq` of `epoch` from `peer`.

        Returns:
            False (nothing applied) on a gap: no snapshot yet, another epoch, or `seq` is not
            the next event number. The caller then resynchronises with a fresh snapshot.
        """
        with self._lock:
            if self._position.get(peer) != (epoch, seq - 1):
                return False
            held = self._keys[peer]
            for key in lost:
                self._remove(peer, key, held)
            for key in gained:
                self._add(peer, key, held)
            self._position[peer] = (epoch, seq)
            return True

    def in_step(self, peer: Peer, epoch: bytes, seq: int) -> bool:
        """Whether `peer`'s heartbeat (`epoch`, last `seq`) matches what was applied."""
        with self._lock:
            return self._position.get(peer) == (epoch, seq)

    def position(self, peer: Peer) -> tuple[bytes, int] | None:
        """(epoch, seq) of the last event applied from `peer`, or None before its snapshot."""
        with self._lock:
            return self._position.get(peer)

    def forget(self, peer: Peer, keys: Iterable[ChunkKey]) -> None:
        """Drop `peer`'s entries of `keys`: one a load found stale, and the later chunks of its
        prefix (`SecondaryTier.forget`). The peer announces them again only in a fresh
        snapshot (a resync or its restart) or as a new gain."""
        with self._lock:
            held = self._keys.get(peer)
            if held is not None:
                for key in keys:
                    self._remove(peer, key, held)

    def drop_peer(self, peer: Peer) -> None:
        """Forget every entry of `peer` (it went away); the next feed starts from a snapshot."""
        with self._lock:
            self._drop(peer)

    def _add(self, peer: Peer, key: ChunkKey, held: set[ChunkKey]) -> None:
        if key in held:
            return
        held.add(key)
        self._holders.setdefault(key, []).insert(0, peer)

    def _remove(self, peer: Peer, key: ChunkKey, held: set[ChunkKey]) -> None:
        if key not in held:
            return
        held.discard(key)
        peers = self._holders[key]
        peers.remove(peer)
        if not peers:
            del self._holders[key]

    def _drop(self, peer: Peer) -> None:
        self._position.pop(peer, None)
        for key in list(self._keys.pop(peer, ())):
            peers = self._holders[key]
            peers.remove(peer)
            if not peers:
                del self._holders[key]
