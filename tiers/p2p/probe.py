"""What a named peer holds, for the requests that pull from it by key (`remote_kv_source`).

A load-balancing request names the peer to pull its prefix from (`orchestration.py`); the peer
may hold all of it, part of it or none. vLLM's tier asks the peer before it answers such a
lookup (`P2PSecondaryTierManager.lookup`, `do_probe`: RETRY until the peer's `LookupRespMsg`
came, then HIT or MISS), and so does this one, without blocking the manager: the first lookup
of a (request, key) queues the key and answers RETRY (the manager's answer is then UNDECIDED,
and vLLM asks again on a later step, `kvhal.tier.Lookup`); one probe thread at a time per
peer asks it about every key queued for it (`probe(keys)` → `held(keys)`, one round trip per
`MAX_KEYS_PER_FRAME` keys, bounded by `timeout_s`), and the request's later lookups of those
keys answer HIT or MISS. A peer that cannot be asked in time makes every key asked a MISS
(counted in `probe_failed`, logged): the request computes them.

The peer answers from what it holds at that moment (readable in its host tier, or in its own
store) and pins nothing: a chunk it loses before the pull fails that pull, and the request's
later lookups of it MISS (`failed`), as with a stale directory entry. Answers live as long as
their request (`open` ... `close_request`).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Hashable, Sequence

from kvhal.keys import ChunkKey

from kvhal.tier import Lookup
from ..jobs import JobPool
from .client import PullError, format_peer
from .directory import Peer

logger = logging.getLogger(__name__)

Ask = Callable[[Peer, Sequence[ChunkKey], float], set[ChunkKey]]


class Probes:
    """Per-request answers of named peers (see module docstring). Thread-safe; `lookup` never
    blocks on I/O.

    Args:
        ask: `ask(peer, keys, deadline)` → the keys `peer` holds (`client.Puller.probe`);
            raises `PullError` if the peer could not be asked by `deadline` (monotonic s).
        timeout_s: Longest a probe may take.
        threads: Probe threads (peers asked at once).
        count: `count(name, n=1)` adds to a tier counter ("probed_keys": keys asked about,
            "probe_failed": keys asked of a peer that did not answer).
    """

    def __init__(self, ask: Ask, *, timeout_s: float, threads: int,
                 count: Callable[..., None]):
        self._ask = ask
        self._timeout_s = timeout_s
        self._count = count
        self._pool = JobPool(threads, "kvhal-p2p-probe")
        self._lock = threading.Lock()
        self._answers: dict[Hashable, dict[ChunkKey, Lookup]] = {}   # request -> key -> answer
        self._queued: dict[Peer, list[tuple[Hashable, ChunkKey]]] = {}
        self._asking: set[Peer] = set()         # peers a probe thread is draining

    def open(self, request: Hashable) -> None:
        """Start answering for `request` (nothing asked yet)."""
        with self._lock:
            self._answers.setdefault(request, {})

    def lookup(self, request: Hashable, peer: Peer, key: ChunkKey) -> Lookup:
        """HIT or MISS once `peer` answered for `key`; RETRY while it is being asked (the
        first call queues the question). MISS for a request not open."""
        with self._lock:
            answers = self._answers.get(request)
            if answers is None:
                return Lookup.MISS
            found = answers.get(key)
            if found is not None:
                return found
            answers[key] = Lookup.RETRY
            self._queued.setdefault(peer, []).append((request, key))
            if peer in self._asking:
                return Lookup.RETRY
            self._asking.add(peer)
            try:
                self._pool.submit(self._drain, peer)
            except RuntimeError:          # closing: nobody will ask
                self._asking.discard(peer)
                del self._queued[peer]
                answers[key] = Lookup.MISS
                return Lookup.MISS
        return Lookup.RETRY

    def failed(self, request: Hashable, key: ChunkKey) -> None:
        """A pull of `key` for `request` failed: its later lookups MISS."""
        with self._lock:
            answers = self._answers.get(request)
            if answers is not None:
                answers[key] = Lookup.MISS

    def close_request(self, request: Hashable) -> None:
        """Forget `request`'s answers (an answer still on its way is dropped)."""
        with self._lock:
            self._answers.pop(request, None)

    def close(self) -> None:
        """Let the probes in flight end (each within `timeout_s`), stop the threads."""
        self._pool.shutdown(wait=True)

    def _drain(self, peer: Peer) -> None:
        """Ask `peer` about every key queued for it, until none is left."""
        while True:
            with self._lock:
                batch = self._queued.pop(peer, [])
                if not batch:
                    self._asking.discard(peer)
                    return
            keys = list(dict.fromkeys(key for _, key in batch))
            self._count("probed_keys", len(keys))
            try:
                held = self._ask(peer, keys, time.monotonic() + self._timeout_s)
            except PullError as exc:
                self._count("probe_failed", len(keys))
                logger.info("p2p: could not ask %s which of %d chunks it holds (%s); they are "
                            "misses", format_peer(peer), len(keys), exc)
                held = set()
            with self._lock:
                for request, key in batch:
                    answers = self._answers.get(request)
                    if answers is not None and answers.get(key) is Lookup.RETRY:
                        answers[key] = Lookup.HIT if key in held else Lookup.MISS
