"""The secondary-tier contract (DESIGN §6): `SecondaryTier` and the jobs it runs.

A secondary tier persists or shares chunks beyond the host tier. It never sees device memory:
it gets a `memoryview` of the host region at construction and reads (store) or writes (load)
slot bytes directly. It manages its own capacity and eviction.

Threading: `lookup`, `submit_*`, `get_finished_jobs` are called from the manager's thread and
must not block on I/O; the tier does its I/O on its own threads. A job's host bytes stay
untouched by kvhal until the job is reported finished.
"""
from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Mapping, Protocol, Sequence

from kvhal import plugins
from kvhal.keys import ChunkKey
from kvhal.tier_metrics import MetricSpec, TierMetrics


class Lookup(enum.Enum):
    """Answer of a lookup.

    A tier's (`SecondaryTier.lookup`): HIT (a load would succeed now), MISS, or RETRY (it
    cannot tell yet: a check of its store or a probe of a peer is under way; asked again on a
    later step, the answer settles to HIT or MISS).

    The manager's (`Manager.lookup`): HIT (readable in host memory), MISS, RETRY (on its way
    into host memory: a store or a promotion in flight; part of a hit, loaded once it lands),
    or UNDECIDED (not in host memory, and a secondary tier answered RETRY: not a hit, ask
    again on a later step; vLLM's scheduler likewise defers a request whose lookup a tier
    answered RETRY, `OffloadingConnectorScheduler._maximal_prefix_lookup`).
    """

    HIT = "hit"
    MISS = "miss"
    RETRY = "retry"
    UNDECIDED = "undecided"


class JobKind(enum.Enum):
    """Direction of a tier job, seen from the tier: STORE = host → tier, LOAD = tier → host."""

    STORE = "store"
    LOAD = "load"


#: Largest `TierJob.description` in bytes (a chunk's token ids, parent hash and LoRA name).
MAX_DESCRIPTION_BYTES = 1 << 20


class TierError(ValueError):
    """A tier is misconfigured; the message names the config key and the accepted values."""


@dataclass(frozen=True, slots=True)
class TierJob:
    """One chunk to move between the host region and a tier.

    Attributes:
        job_id: Unique per tier instance; reported back in `JobResult`.
        kind: STORE or LOAD.
        key: The chunk's key.
        offset: Byte offset of the chunk's slot in the host region.
        nbytes: Payload bytes (the canonical chunk size; ≤ slot size).
        request_id: The request the job serves, for a tier that took part in it
            (`SecondaryTier.open_request` answered True); None otherwise. (`request` is
            its former name, still readable.)
        description: For a STORE: what the integration says of the chunk for routers
            (`Manager.describe`: opaque bytes, at most `MAX_DESCRIPTION_BYTES`), for a tier
            that keeps it beside the chunk and gives it back from `take_found`; None if not
            described.
    """

    job_id: int
    kind: JobKind
    key: ChunkKey
    offset: int
    nbytes: int
    request_id: Hashable | None = None
    description: bytes | None = None

    @property
    def request(self) -> Hashable | None:
        """`request_id` under its former name, for tiers written against it."""
        return self.request_id


@dataclass(frozen=True, slots=True)
class JobResult:
    """How a job ended. Every submitted job yields exactly one result.

    Attributes:
        job_id, kind, key: As submitted.
        ok: True if the bytes were fully and verifiably moved. A failed LOAD must never leave
            the caller believing the slot holds the chunk.
        error: Short reason when not ok (e.g. "checksum mismatch", "ENOSPC").
        seconds: Wall time the tier spent on the job.
    """

    job_id: int
    kind: JobKind
    key: ChunkKey
    ok: bool
    error: str | None = None
    seconds: float = 0.0


def job_problem(job: TierJob, host_nbytes: int, namespace: bytes) -> str | None:
    """Why `job` cannot run against a host region of `host_nbytes` bytes, or None if it can.

    A tier reports a non-None answer as a failed `JobResult` with this text as its error.
    """
    if job.key.namespace != namespace:
        return "key namespace differs from the tier's namespace"
    if job.offset < 0 or job.nbytes <= 0 or job.offset + job.nbytes > host_nbytes:
        return (f"slot [{job.offset}, {job.offset + job.nbytes}) outside the host region "
                f"of {host_nbytes} bytes")
    return None


class HostAccess(Protocol):
    """What the engine lets a tier do with the host tier's slots from the tier's own threads
    (offered through `SecondaryTier.attach_host`). Thread-safe; every call is O(1) or O(keys)
    and holds the manager's slot lock only briefly.

    Attributes:
        chunk_nbytes: Payload bytes of every chunk (the slot at a pinned offset holds this many).
        slot_bytes: Bytes per slot: slot s starts at byte `s * slot_bytes` of the host region
            (every job's `offset` is one), its payload first; what follows the page-rounded
            payload is the tail the registered tier types asked for (`TierSpec.host_tail_bytes`),
            which no copy touches.
    """

    chunk_nbytes: int
    slot_bytes: int

    def pin(self, key: ChunkKey) -> int | None:
        """Add a reader to `key`'s slot if it is resident and not being written; returns the
        slot's byte offset in the host region (its bytes stay as they are until `unpin`), or
        None."""

    def unpin(self, offset: int) -> None:
        """Remove the reader `pin` added (a chunk discarded meanwhile is freed now)."""

    def subscribe(self, listener: Callable[[Sequence[ChunkKey], Sequence[ChunkKey]], None]
                  ) -> list[ChunkKey]:
        """Call `listener(gained, lost)` on the manager's thread whenever chunks become
        readable in, or leave, the host tier (it must only queue work: it runs inside the
        manager's calls); returns the chunks readable now, atomically with the subscription."""


class HostSlots:
    """A `HostAccess` that only describes the slots (`chunk_nbytes`, `slot_bytes`): nothing
    can be pinned and no change is ever heard of. For benchmarks and tests that hand a tier
    slots cut as the engine cuts them, without an engine."""

    def __init__(self, chunk_nbytes: int, slot_bytes: int):
        self.chunk_nbytes, self.slot_bytes = chunk_nbytes, slot_bytes

    def pin(self, key: ChunkKey) -> int | None:
        """Nothing is resident: None."""
        return None

    def unpin(self, offset: int) -> None:
        """Nothing was pinned."""

    def subscribe(self, listener: Callable[[Sequence[ChunkKey], Sequence[ChunkKey]], None]
                  ) -> list[ChunkKey]:
        """No chunk is readable and none will become so: []."""
        return []


class SecondaryTier(abc.ABC):
    """Base class of secondary tiers; subclasses register a factory with `TierSpec`.

    Args (of the factory / constructor):
        config: This tier's entry of `secondary_tiers` (a dict; `type` already checked).
        host: Writable memoryview (format "B") of the whole host region.
        namespace: 16-byte namespace digest of the cache this tier serves.
    """

    #: Registered type name ("fs", "obj", "p2p", "memory", ...).
    name: str = "base"
    #: Where the tier keeps chunks, as vLLM's KV events name it (`vllm.distributed.kv_events`
    #: `MEDIUM_CPU` "CPU" for memory, `MEDIUM_STORAGE` "STORAGE" for disks and object stores).
    medium: str = "STORAGE"
    #: "LOCAL" (on this instance) or "REMOTE" (vLLM `Locality`; an object store, a peer).
    locality: str = "LOCAL"
    #: Source of the prompt tokens this tier serves, as vLLM's `CacheHitSource` names it
    #: ("host", "disk", "p2p"; `vllm/v1/metrics/cache_hit_source.py`).
    hit_source: str = "disk"
    #: The tier's own metrics (`kvhal.tier_metrics`): exposed as `kvhal_<name>_<metric>` and,
    #: inside vLLM, `vllm:kv_offload_<name>_<metric>`; updated through `metrics`.
    metric_specs: tuple[MetricSpec, ...] = ()

    @property
    def metrics(self) -> TierMetrics:
        """This instance's declared metrics, by name (`self.metrics["retries"].inc()`), made
        and checked on first use (the engine touches it at start: bad declarations are
        refused then, `kvhal.tier_metrics.MetricDeclarationError` naming tier and metric).
        Updates are thread-safe."""
        made = self.__dict__.get("_kvhal_metrics")
        if made is None:
            made = self.__dict__.setdefault("_kvhal_metrics",
                                            TierMetrics(self.name, self.metric_specs))
        return made

    @abc.abstractmethod
    def lookup(self, key: ChunkKey) -> Lookup:
        """HIT if a load of `key` would succeed now, MISS if not, RETRY while the tier cannot
        tell yet (a check under way; it must settle to HIT or MISS within the tier's own
        bound). Never UNDECIDED (the manager's answer for a RETRY).

        Must not block on I/O. A HIT is a promise made in good faith: the load may still fail
        (file deleted, checksum mismatch) and is then reported as a failed job.
        """

    @abc.abstractmethod
    def submit_store(self, job: TierJob) -> None:
        """Start copying `host[job.offset : job.offset + job.nbytes]` into the tier.

        Storing a key that already exists succeeds without rewriting. Never raises for I/O
        problems: they become a failed `JobResult`.
        """

    @abc.abstractmethod
    def submit_load(self, job: TierJob) -> None:
        """Start copying the chunk `job.key` into `host[job.offset : job.offset + job.nbytes]`.

        A missing, short or corrupt chunk is a failed `JobResult` (never wrong bytes reported
        as ok). Never raises for I/O problems.
        """

    @abc.abstractmethod
    def get_finished_jobs(self) -> list[JobResult]:
        """Results of jobs that finished since the last call (each job exactly once)."""

    @abc.abstractmethod
    def drain(self, timeout_s: float | None = None) -> None:
        """Block until every submitted job has finished (results stay queued for
        `get_finished_jobs`).

        Raises:
            TimeoutError: jobs remain after `timeout_s` seconds.
        """

    def take_removed(self) -> list[ChunkKey]:
        """Keys that left this tier since the last call (evicted, garbage-collected, found
        corrupt or missing, deleted by another instance), each once. The engine turns them
        into `BlockRemoved` events. Never blocks on I/O. Default: none (a tier that never
        drops chunks on its own)."""
        return []

    def take_found(self) -> list[tuple[ChunkKey, bytes | None]]:
        """Chunks this tier came to hold other than by this process's stores, since the last
        call, each once: at start, what its store already holds (a restarted instance
        announces it); later, what a listing found that another process wrote. Each with the
        description it kept (`TierJob.description` of the store that wrote it; None if it
        kept none). The engine announces them as `BlockStored` events
        (`BlockStored.descriptions`). Never blocks on I/O. Default: none (a tier without an
        index of its store)."""
        return []

    def watch(self, on_change: Callable[[], None]) -> None:
        """Have the tier call `on_change()` whenever `take_removed` or `take_found` gained
        keys that no job of this process's engine caused: a listing of its store found
        another process's writes or deletions, a sweep found evictions. Called once, before
        any job; `on_change` may run on any thread of the tier, with none of its locks held,
        and never blocks. An engine that publishes events while idle wakes on it (vLLM steps
        only for a request or a transfer in flight: without it, what an idle instance's
        listing learns waits for the next request). Default: nothing (a tier whose index
        changes only through the engine's own jobs)."""

    def forget(self, keys: Sequence[ChunkKey]) -> None:
        """A load of `keys[0]` from this tier failed; `keys[1:]` are the later chunks of the
        same prefix, in order. Called by the engine on the manager's thread once per failed
        load, after its `JobResult` was collected. Whatever lost `keys[0]` (a dead segment
        owner, a deleted folder, a peer that restarted) likely took the later chunks too, and
        each would otherwise cost a promised hit that fails late: a tier that answers lookups
        from an index of its own drops every key of `keys` it can no longer vouch for, so
        that its lookups miss until it has checked the chunk again or stored it anew, and the
        next `submit_store` of each really writes it (a record its store still lists but can
        no longer serve is replaced, not counted as already stored). Keys that leave an
        index this way are reported by `take_removed` as the tier's other removals are.
        Must not block on I/O. Default: nothing (a tier whose lookups read the chunks
        themselves, not an index, has no stale entry to drop)."""

    def open_request(self, request_id: Hashable, params: Mapping[str, Any]) -> bool:
        """Called by the engine when a request arrives with per-request parameters (vLLM:
        its `kv_transfer_params`, e.g. an orchestrator's P/D instructions), before any of its
        lookups. Returns True if the tier takes part: then the engine asks it
        `lookup_for(key, request_id)` for the request's chunks, passes `TierJob.request_id`
        on the request's promotions and stores (every chunk of the request's prefix, also those
        already in host memory), and calls `close_request` once after the request's last
        store was handed over. Must not block on I/O; a malformed parameter is logged (naming
        the key and the request) and ignored, never raised. Default: False."""
        return False

    def lookup_for(self, key: ChunkKey, request_id: Hashable) -> Lookup:
        """`lookup` for a request the tier took part in (`open_request`). Default: `lookup`."""
        return self.lookup(key)

    def close_request(self, request_id: Hashable) -> None:
        """A request the tier took part in is finished and its last store was submitted
        (`open_request`); each such request once. Must not block on I/O. Default: nothing."""

    def attach_host(self, access: HostAccess) -> None:
        """Called once by the engine, before any job, with thread-safe access to the host
        tier's slots. A tier that serves chunks straight from host memory (p2p) keeps it;
        the default ignores it."""

    @abc.abstractmethod
    def close(self) -> None:
        """Drain, then release threads, files and connections. Idempotent."""

    def publish_event(self, event: Any) -> None:
        """Deliver an event of the tier's own kind (any object: a frozen dataclass naming
        `tier`, its `metrics.label`, is the custom) to every `kvhal_kv_event` hook
        implementation, on the calling thread (any of the tier's; the hooks must be
        thread-safe and quick). Such events go to those subscribers only: vLLM's KV-event
        publisher forwards the engine's `BlockStored` / `BlockRemoved` / `AllBlocksCleared`
        (`Manager.take_events`), never a tier's own kinds. Delivered whatever the engine's
        `emit_events`; a hook's exception propagates to the caller."""
        plugins.emit_kv_event(event)

    def stats(self) -> Mapping[str, Any]:
        """Counters for metrics and reports (bytes stored/loaded, hits, corrupt, evictions).

        The engine's metrics read `used_bytes` (bytes held now) and `max_bytes` (capacity),
        where given."""
        return {}
