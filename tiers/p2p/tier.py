"""`P2PTier`: the `SecondaryTier` face of a p2p instance (design in the package docstring)."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Hashable, Mapping, Sequence

from kvhal.keys import ChunkKey

from kvhal.tier import HostAccess, Lookup, TierError, TierJob, job_problem
from kvhal.tier_metrics import MetricSpec
from ..index import MAX_REMEMBERED_REMOVALS
from ..jobs import BoardedTier, JobBoard, JobPool
from .client import FeedLink, Puller, PullError, format_peer
from .config import listen_port, parse_address, parse_config
from .directory import Directory, Peer
from .orchestration import Orchestration, parse
from .parking import ID_REFUSALS, Parking
from .probe import Probes
from .server import Server
from .source import Feed, HostSource, OwnStore
from .transport import TcpTransport, Transport

logger = logging.getLogger(__name__)

#: Longest silence of a feed (seconds) before its peer counts as gone: 3 heartbeats.
MISSED_HEARTBEATS = 3
#: `stats()` counters that are refused or failed handshakes → `handshakes_refused` reason.
_REFUSALS = {"auth_failed": "auth_failed", "handshake_timeouts": "timeout",
             "handshakes_dropped": "dropped", "connections_refused": "full"}


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
        data_parallel_index: The serving engine's data-parallel index (vLLM's
            `parallel_config.data_parallel_index`, passed by `kvhal.config.build_tiers`):
            the listener binds `port` + it, as vLLM's p2p tier does, so each DP engine of a
            server has its own port (a `port` of 0 stays ephemeral).

    Attributes:
        identity: "host:port" peers name this instance by: the bound port, i.e. `port` +
            `data_parallel_index` (an ephemeral one if `port` is 0).

    Raises:
        TierError: bad config, a negative `data_parallel_index` or one that puts the port
            past 65535, or the listener cannot bind (`port: ...`).
    """

    name = "p2p"
    medium = "CPU"          # a peer's host memory (vLLM's p2p tier: CacheHitSource.P2P)
    locality = "REMOTE"
    hit_source = "p2p"
    metric_specs = (
        MetricSpec("handshakes_refused", "counter", "Handshakes that failed or were refused, "
                   "by reason (auth_failed: a peer failed our challenge or refused our proof; "
                   "timeout; dropped: too many handshaking; full: too many connections)",
                   labels={"reason": tuple(_REFUSALS.values())}),
        MetricSpec("peers_connected", "gauge", "Configured peers whose feed is installed now"),
        MetricSpec("pulls_waiting", "gauge", "Decode legs' pulls waiting now on their "
                   "prefiller for a parked chunk"),
    )

    def __init__(self, config: Mapping[str, Any], host: memoryview, namespace: bytes, *,
                 transport: Transport | None = None, data_parallel_index: int = 0):
        cfg = parse_config(config)
        if not host.contiguous or host.itemsize != 1:
            raise TierError("host: the host region must be a C-contiguous byte memoryview")
        port = listen_port(cfg.port, data_parallel_index)
        self.config = cfg
        self.namespace = bytes(namespace)
        self._host = host
        self._jobs = JobBoard("p2p")
        for name, reason in _REFUSALS.items():
            self._jobs.meter(name, self.metrics["handshakes_refused"].labels(reason))
        self._waiting = self.metrics["pulls_waiting"].labels()
        self._feed = Feed()
        self._source: OwnStore | HostSource = OwnStore(cfg.max_bytes, self._feed,
                                                            self._jobs.count)
        self._directory = Directory()
        self._parking = Parking(lambda key: self._source.hold(key),
                                unbound_s=cfg.unbound_store_timeout_s,
                                arrival_s=cfg.arrival_timeout_s, count=self._jobs.count)
        # request id -> its orchestration (manager's thread; read by pull threads)
        self._requests: dict[Hashable, Orchestration] = {}
        self._refused: set[Hashable] = set()  # decode legs whose prefiller refused the id
        # decode leg -> latest generation of its parked record it fetched from (`parking.py`)
        self._fetched_gen: dict[Hashable, int] = {}
        # prefill leg -> generation of the record it opened (`parking.py`)
        self._park_gen: dict[Hashable, int] = {}
        self._lock = threading.Lock()
        #: key -> the peer whose pull of it failed as stale, until `forget` of it (oldest
        #: first, at most `MAX_REMEMBERED_REMOVALS`; pull threads write, `forget` reads).
        self._stale_from: dict[ChunkKey, Peer] = {}
        transport = transport or TcpTransport()
        beat = heartbeat_s(cfg.timeout_s)
        try:
            self._server = Server(transport, cfg.host, port, cfg.auth_key, self._feed,
                                  self._source, timeout_s=cfg.timeout_s, heartbeat_s=beat,
                                  max_inflight=cfg.max_inflight, count=self._jobs.count,
                                  parking=self._parking)
        except OSError as exc:
            self._parking.close()
            raise TierError(f"port: cannot listen on {cfg.host}:{port} "
                            f"({exc.strerror or exc})") from None
        self._self_peer = (cfg.advertise_host, self._server.address[1])
        self.identity = format_peer(self._self_peer)
        # Unattached, this instance's own store is one of the peers it pulls from.
        seq, keys = self._feed.listen(self._own_event)
        self._directory.replace(self._self_peer, self._feed.epoch, seq, keys)
        self._attached = False
        self._puller = Puller(transport, cfg.auth_key, self.identity, self._jobs.count)
        self._probes = Probes(self._puller.probe, timeout_s=cfg.timeout_s,
                              threads=cfg.num_threads, count=self._jobs.count)
        self._pullers = JobPool(cfg.num_threads, "kvhal-p2p-pull")
        self._storers = JobPool(1, "kvhal-p2p-store")
        self._links = [FeedLink(peer, transport, cfg.auth_key, self.identity,
                                self._directory, timeout_s=cfg.timeout_s,
                                silence_s=MISSED_HEARTBEATS * beat, count=self._jobs.count,
                                on_lost=self._puller.forget_peer)
                       for peer in cfg.peers
                       if peer not in (self._self_peer, (cfg.host, self._self_peer[1]))]
        self.metrics["peers_connected"].set_function(
            lambda: sum(link.synced.is_set() for link in self._links))

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

    def open_request(self, request_id: Hashable, params: Mapping[str, Any]) -> bool:
        """Take part in a request whose `kv_transfer_params` carry p2p orchestration
        (`orchestration.py`): a prefill leg opens its parking record now (a reaped id, or one
        its decoder already gave up, parks nothing: logged); a decode leg or a
        `remote_kv_source` pulls from the named peer (the latter after asking it,
        `probe.py`)."""
        orch = parse(params, request_id)
        if orch is None or self._jobs.closed:
            return False
        if orch.source is not None and not orch.parked:
            self._probes.open(request_id)
        gen = 0
        if orch.park_id is not None:
            gen, why = self._parking.open(orch.park_id)
            if why is not None:
                logger.warning("request %s: kv_transfer_params.remote_decoder.kv_request_id "
                               "%r is %s; its chunks are not parked (the decoder recomputes)",
                               request_id, orch.park_id, why)
        with self._lock:
            self._requests[request_id] = orch
            self._park_gen[request_id] = gen
        return True

    def lookup_for(self, key: ChunkKey, request_id: Hashable) -> Lookup:
        """A decode leg (`remote_prefiller`): HIT while its prefiller has not refused its id
        (the pull waits for the chunk and says whether it comes; vLLM's tier answers a decode
        leg the same way). A `remote_kv_source` request: the named peer is asked first, RETRY
        until it answered, then HIT if it holds `key`, else MISS (`probe.py`; vLLM's tier
        probes too). Other requests: as `lookup`. No I/O."""
        orch = self._requests.get(request_id)
        if orch is None or orch.source is None:
            return self.lookup(key)
        if self._jobs.closed or request_id in self._refused:
            return Lookup.MISS
        return Lookup.HIT if orch.parked else self._probes.lookup(request_id, orch.source, key)

    def close_request(self, request_id: Hashable) -> None:
        """A prefill leg's record is sealed (the decoder is refused chunks it lacks at once);
        a decode leg tells its prefiller it is done, naming the latest generation of the
        parked record it fetched from: that record's chunks are released, never those of a
        newer leg under a reused id (`parking.py`)."""
        with self._lock:
            orch = self._requests.pop(request_id, None)
            gen = self._fetched_gen.pop(request_id, 0)
            park_gen = self._park_gen.pop(request_id, 0)
        self._refused.discard(request_id)
        self._probes.close_request(request_id)
        if orch is None:
            return
        if orch.park_id is not None:
            self._parking.seal(orch.park_id, park_gen)
        if orch.parked and not self._jobs.closed:
            deadline = time.monotonic() + self.config.timeout_s
            try:
                self._pullers.submit(self._finish_remote, orch, gen, deadline)
            except RuntimeError:
                pass  # closing: the prefiller reaps the id

    def _finish_remote(self, orch: Orchestration, gen: int, deadline: float) -> None:
        try:
            self._puller.finish(orch.source, orch.fetch_id, gen, deadline)
        except PullError as exc:
            logger.info("p2p: could not tell %s that kv_request_id %r is done (%s); it "
                        "releases the chunks when it reaps the id", format_peer(orch.source),
                        orch.fetch_id, exc)

    def submit_store(self, job: TierJob) -> None:
        """Make the chunk available to peers (see `SecondaryTier.submit_store`). Attached to a
        host tier the chunk is served from its slot already: the job ends here, at once. A
        prefill leg's chunk is also parked under its id (pinned until its decoder is done);
        the store of a request whose `remote_decoder` block is malformed fails at once with
        `Orchestration.park_error`, storing nothing (vLLM's p2p tier fails it too)."""
        orch = self._requests.get(job.request_id) if job.request_id is not None else None
        if orch is not None and orch.park_error is not None:
            self._jobs.finish(job, orch.park_error)
            return
        park = None
        if orch is not None and orch.park_id is not None:
            park = (orch.park_id, self._park_gen.get(job.request_id, 0))
        if self._attached:
            problem = job_problem(job, len(self._host), self.namespace)
            if problem is None and park is not None:
                problem = self._park(park, job.key)
            self._jobs.finish(job, problem)
        else:
            self._jobs.submit(self._storers, lambda j: self._store(j, park), job)

    def _park(self, park: tuple[str, int], key: ChunkKey) -> str | None:
        """Park `key` under (kv_request_id, generation of the record the leg opened)."""
        why = self._parking.park(park[0], park[1], key)
        return None if why is None else f"kv_request_id {park[0]!r}: {why}"

    def submit_load(self, job: TierJob) -> None:
        """Pull the chunk, within `timeout_s` of this call: from the peer a request names
        (a decode leg waits up to `fetch_wait_s` more for its prefiller to store it), else
        from a peer that announced it."""
        orch = self._requests.get(job.request_id) if job.request_id is not None else None
        if orch is not None and orch.source is None:
            orch = None
        wait = orch is not None and orch.parked
        deadline = time.monotonic() + self.config.timeout_s + (
            self.config.fetch_wait_s if wait else 0.0)
        self._jobs.submit(self._pullers, lambda j: self._load(j, deadline, orch), job)


    def forget(self, keys: Sequence[ChunkKey]) -> None:
        """If the pull of `keys[0]` failed because its peer no longer holds it (not merely
        busy), drop that peer's directory entries of `keys[1:]` too (see
        `SecondaryTier.forget`): the peer likely lost the whole prefix. Other peers' entries
        stay: their announcements are not in doubt. Unattached, a failed pull from this
        instance itself makes its own store drop `keys` (`OwnStore.forget`: their next store
        copies them in anew). No I/O."""
        if not keys:
            return
        with self._lock:
            peer = self._stale_from.pop(keys[0], None)
        if peer is None:
            return
        self._directory.forget(peer, keys[1:])
        if peer == self._self_peer and isinstance(self._source, OwnStore):
            self._source.forget(keys)

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
        self._probes.close()
        for link in self._links:
            link.close()
        self._feed.close()
        self._parking.close()
        self._server.close()
        self._puller.close()

    def stats(self) -> Mapping[str, Any]:
        """Counters (absent while 0): bytes_stored, already_stored (stores of chunks the own
        store held already), bytes_loaded, store_failed, load_failed,
        load_missing, chunks_served, serve_digests, serve_missing, serve_busy, serve_corrupt,
        checksum_mismatch, malformed, auth_failed, connections_refused, handshakes_dropped,
        handshake_timeouts, peer_lost, feed_resyncs, parked_chunks, park_reused, park_reaped,
        park_late (prefill legs opened after their decoder gave up: nothing parked),
        done_stale (a decoder's late `done` of an earlier use of a reused id: ignored),
        fetch_refused, probed_keys / probe_failed (keys this instance asked named peers about,
        and those of them that got no answer: `probe.py`), probes_served; plus served_chunks,
        directory_chunks, peers, peers_synced, connections (served + pooled data
        connections), attached (bool), parked_ids and parked_held (P/D
        records and the chunks they pin now), fetches_waiting (decoders' fetches waiting here
        now for a chunk or for their prefill leg)."""
        served = self._feed.snapshot()[1]
        return self._jobs.counters() | self._parking.stats() | {
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
    def _store(self, job: TierJob, park: tuple[str, int] | None) -> str | None:
        if (problem := job_problem(job, len(self._host), self.namespace)) is not None:
            return problem
        error = self._source.put(job.key, self._host[job.offset:job.offset + job.nbytes])
        if error is None and park is not None:
            error = self._park(park, job.key)
        return error

    def _load(self, job: TierJob, deadline: float, orch: Orchestration | None
              ) -> str | None:
        if (problem := job_problem(job, len(self._host), self.namespace)) is not None:
            return problem
        if time.monotonic() >= deadline:
            return "timed out before a pull thread was free"
        if orch is not None:
            return self._pull_named(job, deadline, orch)
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
                self._directory.forget(peer, [job.key])
                with self._lock:
                    self._stale_from[job.key] = peer
                    while len(self._stale_from) > MAX_REMEMBERED_REMOVALS:
                        del self._stale_from[next(iter(self._stale_from))]
            return str(exc)
        self._jobs.count("bytes_loaded", job.nbytes)
        return None

    def _pull_named(self, job: TierJob, deadline: float, orch: Orchestration) -> str | None:
        """Pull from the peer the request names (no directory): a decode leg fetches the
        chunk parked under its id; a refused id fails the request's later lookups too."""
        parked = None
        if orch.parked:
            parked = (orch.fetch_id, max(0.0, deadline - time.monotonic()
                                         - self.config.timeout_s))
        if parked is not None:
            self._waiting.inc()
        try:
            gen = self._puller.pull(orch.source, job.key,
                                    self._host[job.offset:job.offset + job.nbytes], deadline,
                                    parked)
        except PullError as exc:
            if exc.why in ID_REFUSALS:
                self._refused.add(job.request_id)
            if not orch.parked:       # the peer lost it since it said it held it
                self._probes.failed(job.request_id, job.key)
            return str(exc)
        finally:
            if parked is not None:
                self._waiting.inc(-1)
        if orch.parked:
            with self._lock:
                if job.request_id in self._requests:   # its `done` not sent yet
                    self._fetched_gen[job.request_id] = max(
                        gen, self._fetched_gen.get(job.request_id, 0))
        self._jobs.count("bytes_loaded", job.nbytes)
        return None
