"""`P2PTier`: the `SecondaryTier` face of a p2p instance (design in the package docstring)."""
from __future__ import annotations

import time
from typing import Any, Mapping

from kvhal.keys import ChunkKey

from ..base import HostAccess, Lookup, TierError, TierJob, job_problem
from ..jobs import BoardedTier, JobBoard, JobPool
from .client import FeedLink, Puller, PullError, format_peer
from .config import parse_address, parse_config
from .directory import Directory
from .server import Server
from .source import Feed, HostSource, OwnStore
from .transport import TcpTransport, Transport

#: Longest silence of a feed (seconds) before its peer counts as gone: 3 heartbeats.
MISSED_HEARTBEATS = 3


def heartbeat_s(timeout_s: float) -> float:
    """Heartbeat interval of feeds for a tier with `timeout_s`: a quarter of it, in
    [0.05, 1.0] s, so a silent peer is dropped within 3 heartbeats (≤ 0.75 × timeout_s)."""
    return min(1.0, max(0.05, timeout_s / 4))


class P2PTier(BoardedTier):
    """The p2p tier (see the package docstring; config keys in `config.py`).

    Args:
        config: This tier's `secondary_tiers` entry.
        host: Writable, C-contiguous memoryview (format "B") of the host region.
        namespace: 16-byte namespace digest; only keys of it are stored or loaded.
        transport: How bytes move (default plain TCP).

    Attributes:
        identity: "host:port" peers name this instance by (the bound port if `port` is 0).

    Raises:
        TierError: bad config, or the listener cannot bind (`port: ...`).
    """

    name = "p2p"
    medium = "CPU"          # a peer's host memory (vLLM's p2p tier: CacheHitSource.P2P)
    locality = "REMOTE"
    hit_source = "p2p"

    def __init__(self, config: Mapping[str, Any], host: memoryview, namespace: bytes, *,
                 transport: Transport | None = None):
        cfg = parse_config(config)
        if not host.contiguous or host.itemsize != 1:
            raise TierError("host: the host region must be a C-contiguous byte memoryview")
        self.config = cfg
        self.namespace = bytes(namespace)
        self._host = host
        self._jobs = JobBoard("p2p")
        self._feed = Feed()
        self._source: OwnStore | HostSource = OwnStore(cfg.max_bytes, self._feed)
        self._directory = Directory()
        transport = transport or TcpTransport()
        beat = heartbeat_s(cfg.timeout_s)
        try:
            self._server = Server(transport, cfg.host, cfg.port, cfg.auth_key, self._feed,
                                  self._source, timeout_s=cfg.timeout_s, heartbeat_s=beat,
                                  max_inflight=cfg.max_inflight, count=self._jobs.count)
        except OSError as exc:
            raise TierError(f"port: cannot listen on {cfg.host}:{cfg.port} "
                            f"({exc.strerror or exc})") from None
        self._self_peer = (cfg.advertise_host, self._server.address[1])
        self.identity = format_peer(self._self_peer)
        # Unattached, this instance's own store is one of the peers it pulls from.
        seq, keys = self._feed.listen(self._own_event)
        self._directory.replace(self._self_peer, self._feed.epoch, seq, keys)
        self._attached = False
        self._puller = Puller(transport, cfg.auth_key, self.identity, self._jobs.count)
        self._pullers = JobPool(cfg.num_threads, "kvhal-p2p-pull")
        self._storers = JobPool(1, "kvhal-p2p-store")
        self._links = [FeedLink(peer, transport, cfg.auth_key, self.identity,
                                self._directory, timeout_s=cfg.timeout_s,
                                silence_s=MISSED_HEARTBEATS * beat, count=self._jobs.count,
                                on_lost=self._puller.forget_peer)
                       for peer in cfg.peers
                       if peer not in (self._self_peer, (cfg.host, self._self_peer[1]))]

    def __repr__(self) -> str:
        return f"P2PTier(identity={self.identity!r}, peers={len(self._links)})"

    def _own_event(self, epoch: bytes, seq: int, gained, lost) -> None:
        if not self._attached:
            self._directory.apply(self._self_peer, epoch, seq, gained, lost)

    # -- SecondaryTier ------------------------------------------------------------------------
    def attach_host(self, access: HostAccess) -> None:
        """Serve the host tier's chunks straight from their slots from now on (no copies; a
        store job then only confirms the chunk is served), and stop pulling from ourselves."""
        self._attached = True
        self._directory.drop_peer(self._self_peer)
        self._source = HostSource(access, self._host, self._feed, self._jobs.count)
        self._server.source = self._source

    def lookup(self, key: ChunkKey) -> Lookup:
        """HIT if a peer announced `key` (a directory read, no I/O; the pull may still fail)."""
        return Lookup.HIT if not self._jobs.closed and key in self._directory else Lookup.MISS

    def submit_store(self, job: TierJob) -> None:
        """Make the chunk available to peers (see `SecondaryTier.submit_store`). Attached to a
        host tier the chunk is served from its slot already: the job ends here, at once."""
        if self._attached:
            self._jobs.finish(job, job_problem(job, len(self._host), self.namespace))
        else:
            self._jobs.submit(self._storers, self._store, job)

    def submit_load(self, job: TierJob) -> None:
        """Pull the chunk from a peer that announced it, within `timeout_s` of this call."""
        deadline = time.monotonic() + self.config.timeout_s
        self._jobs.submit(self._pullers, lambda j: self._load(j, deadline), job)


    def take_removed(self) -> list[ChunkKey]:
        """Keys this instance stopped serving since the last call (evicted from the own
        store, or lost by the attached host tier)."""
        return self._source.take_removed()

    def close(self) -> None:
        """Finish pending jobs, then stop feeds, listener and connections and join every
        thread. Idempotent."""
        if not self._jobs.close():
            return
        self._pullers.shutdown(wait=True)
        self._storers.shutdown(wait=True)
        for link in self._links:
            link.close()
        self._feed.close()
        self._server.close()
        self._puller.close()

    def stats(self) -> Mapping[str, Any]:
        """Counters (absent while 0): bytes_stored, bytes_loaded, store_failed, load_failed,
        load_missing, chunks_served, serve_digests, serve_missing, serve_busy, serve_corrupt,
        checksum_mismatch, malformed, auth_failed, connections_refused, handshakes_dropped,
        handshake_timeouts, peer_lost, feed_resyncs; plus served_chunks, directory_chunks,
        peers, peers_synced, connections (served + pooled data connections) and attached
        (bool)."""
        served = self._feed.snapshot()[1]
        return self._jobs.counters() | {
            "served_chunks": len(served), "directory_chunks": self._directory.count(),
            "peers": len(self._links),
            "peers_synced": sum(link.synced.is_set() for link in self._links),
            "connections": self._server.connections + self._puller.connections(),
            "attached": self._attached}

    def wait_synced(self, timeout_s: float) -> bool:
        """Wait until every configured peer's feed is installed (tests, benches, startup);
        False if one is not within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        return all(link.synced.wait(max(0.0, deadline - time.monotonic()))
                   for link in self._links)

    def feed_position(self) -> tuple[bytes, int]:
        """(epoch, seq) of the last change this instance announced to its peers."""
        return self._feed.epoch, self._feed.seq

    def in_step_with(self, peer: "P2PTier") -> bool:
        """Whether this instance has applied everything `peer` (a tier in this process, one of
        its configured peers) announced so far: its directory is exact, not lagging (the
        replay harness waits for this between requests, so that hits do not depend on
        timing)."""
        holder = parse_address(peer.identity, "peer")
        return self._directory.position(holder) == peer.feed_position()

    # -- jobs ---------------------------------------------------------------------------------
    def _store(self, job: TierJob) -> str | None:
        if (problem := job_problem(job, len(self._host), self.namespace)) is not None:
            return problem
        error = self._source.put(job.key, self._host[job.offset:job.offset + job.nbytes])
        if error is None:
            self._jobs.count("bytes_stored", job.nbytes)
        return error

    def _load(self, job: TierJob, deadline: float) -> str | None:
        if (problem := job_problem(job, len(self._host), self.namespace)) is not None:
            return problem
        if time.monotonic() >= deadline:
            return "timed out before a pull thread was free"
        holders = self._directory.holders(job.key)
        if not holders:
            self._jobs.count("load_missing")
            return "no peer holds the chunk"
        peer = holders[0]
        try:
            self._puller.pull(peer, job.key, self._host[job.offset:job.offset + job.nbytes],
                              deadline)
        except PullError as exc:
            if not str(exc).endswith(": busy"):
                self._directory.forget(peer, job.key)
            return str(exc)
        self._jobs.count("bytes_loaded", job.nbytes)
        return None
