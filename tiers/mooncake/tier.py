"""`mooncake`: the Mooncake Store secondary tier — KV in a distributed memory pool.

Each chunk is one object of the pool holding exactly one chunk record
(`kvhal.tiers.chunk_format`, as fs files and obj objects) under the name `<prefix>/<namespace
hex>/<ChunkKey.hex()>` (prefix default "kvhal"). Zero-copy: the whole host region is registered
with the store's transfer engine at start, and a batch of chunks moves with one
`batch_put_from_multi_buffers` / `batch_get_into_multi_buffers` call: the payload goes straight
between the pool and the host slot. Attached to an engine whose slots keep a tail of a header
(`TierSpec.host_tail_bytes`, `HostAccess.slot_bytes`), each record of slot s ≥ 1 is one
contiguous buffer: its 4 KiB header in the unused tail of slot s-1, then the payload, then the
padding in slot s's own page rounding. Otherwise (slot 0, or no tail) its buffers are [header,
slot, padding] with the header and padding in a registered scratch area. The separate 4 KiB
buffer is what the contiguous record saves: `kvhal bench tier --tier mooncake` ("raw +header"
over "raw put_from/get_into", geometric mean of 10 passes, 2-core VM) read 0.70x at 256 KiB
(write 0.97x), 0.98-1.01x at 2 MiB (write 0.90-0.99x).
A load is reported ok only after the header (magic, key, namespace, sizes) and the payload's
xxh3-128 are verified in the slot; a missing object (evicted by the pool, lost with its master
or its segment's owner), a short or corrupt record or a failed call is a failed job (a miss)
with a counter, never wrong bytes reported as loaded; a corrupt object is removed from the
pool.

Capacity and eviction are the pool's (`mooncake_master -eviction_high_watermark_ratio`, leases,
soft pins); the tier evicts nothing itself. A full pool (`NO_AVAILABLE_HANDLE`) fails stores
with the counter `pool_full`. Lookups answer from the index (`probe.py`); stores of a key the
pool already holds succeed without a transfer, except a key forgotten after a failed load
(`forget`): its object is removed first, as the pool keeps listing the objects of a segment
whose owner died until its master drops the owner, and a put of a listed name writes nothing. While the client finds the master unreachable
(`health_check`), jobs fail at once (`master_unreachable`); the client reconnects by itself.
"""
from __future__ import annotations

import threading
from collections import Counter
from functools import partial
from typing import Any, Mapping, Sequence

from kvhal.keys import ChunkKey

from kvhal.tier import Lookup, TierError, TierJob, job_problem
from kvhal.tier_metrics import MetricSpec
from ..chunk_format import (ALIGN, HEADER_BYTES, CorruptChunk, SizeMismatch,
                            check_record_size, checked_header, encode_header,
                            payload_checksum, record_nbytes, verify_payload)
from ..index import ChunkIndex
from ..jobs import IndexedTier, JobBoard, JobPool, LanePool
from .client import (GONE, NO_AVAILABLE_HANDLE, OBJECT_ALREADY_EXISTS, connect,
                     error_name, list_names, register, replicate_config)
from .config import parse_config
from .pool_figures import PoolFigures
from .probe import Prober

#: Most chunks one pool thread moves in one Mooncake batch call.
MAX_BATCH = 16


def object_name(prefix: str, namespace: bytes, key: ChunkKey) -> str:
    """The pool object name of `key` of `namespace` under `prefix`."""
    return f"{prefix}/{namespace.hex()}/{key.hex()}"


class MooncakeTier(IndexedTier):
    """The mooncake tier (see module docstring; config keys in `config.py`).

    Args:
        config: This tier's `secondary_tiers` entry.
        host: Writable, C-contiguous memoryview (format "B") of the host region.
        namespace: 16-byte namespace digest; objects are named `<prefix>/<namespace hex>/...`.

    Raises:
        TierError: bad config, the `mooncake` extra or libibverbs missing, the pool
            unreachable at start, or the host region refused by the transfer engine.
    """

    name = "mooncake"
    medium = "CPU"          # pooled DRAM of other nodes
    locality = "REMOTE"
    hit_source = "p2p"      # vLLM's CacheHitSource for KV from other hosts' memory
    metric_specs = (
        MetricSpec("pool_used_bytes", "gauge", "Bytes allocated in the pool, as its master "
                   "reports them (config master_metrics_address; 0 without)"),
        MetricSpec("pool_capacity_bytes", "gauge", "Bytes the pool's mounted segments hold, "
                   "as its master reports them (config master_metrics_address; 0 without)"),
        MetricSpec("puts_refused", "counter", "Chunks whose put the pool refused, by reason "
                   "(pool_full: no space, NO_AVAILABLE_HANDLE; error: any other code)",
                   labels={"reason": ("pool_full", "error")}),
    )

    def __init__(self, config: Mapping[str, Any], host: memoryview, namespace: bytes):
        cfg = parse_config(config)
        if not host.contiguous or host.itemsize != 1 or host.readonly:
            raise TierError("host: the host region must be a writable, C-contiguous byte "
                            "memoryview")
        self.config = cfg
        self.namespace = bytes(namespace)
        self._host = host
        self._client = connect(cfg)
        threads = 2 * cfg.io_threads
        # per thread: MAX_BATCH headers, then one ALIGN of padding (zeros on stores, a sink on
        # loads: a record's padding is never read back into a slot)
        self._scratch = memoryview(bytearray((MAX_BATCH * HEADER_BYTES + ALIGN) * threads))
        self._registered: list[int] = []
        try:
            self._host_addr = register(self._client, host, "host")
            self._registered.append(self._host_addr)
            self._registered.append(register(self._client, self._scratch, "host"))
        except TierError:
            self._close_store()
            raise
        self._free_scratch = list(range(threads))
        self._scratch_lock = threading.Lock()
        #: Slot size whose tails hold a record header (`attach_host`), or None.
        self._stride: int | None = None
        self._local = threading.local()
        self._replicate = replicate_config(cfg.replica_num)
        self._jobs = JobBoard("mooncake")
        self._puts_refused = self.metrics["puts_refused"]
        self._pool_figures = None if cfg.master_metrics_address is None else PoolFigures(
            f"http://{cfg.master_metrics_address}/metrics", cfg.refresh_interval_s)
        if self._pool_figures is not None:
            figures = self._pool_figures
            self.metrics["pool_used_bytes"].set_function(lambda: figures.used)
            self.metrics["pool_capacity_bytes"].set_function(lambda: figures.capacity)
        self._index = ChunkIndex()
        lister = (None if cfg.master_metrics_address is None else
                  partial(list_names, cfg.master_metrics_address, cfg.timeout_s))
        self._prober = Prober(self._index, self._exist, cfg.refresh_interval_s,
                              cfg.sweep_interval_s, cfg.timeout_s, self._jobs.count,
                              lister, self.object_name, cfg.list_interval_s)
        self._pool = LanePool((cfg.io_threads, cfg.io_threads), "kvhal-mooncake",
                              (partial(self._jobs.run_batch, self._load_batch),
                               partial(self._jobs.run_batch, self._store_batch)), MAX_BATCH)
        self._load_pool, self._store_pool = self._pool.lanes
        #: (threads that may run loads, threads that may run stores): the store threads also
        #: load while no store is queued (`LanePool`).
        self.io_threads = (2 * cfg.io_threads, cfg.io_threads)
        self._remover = JobPool(1, "kvhal-mooncake-remove")

    def __repr__(self) -> str:
        return (f"MooncakeTier(master={self.config.master_server_address}, "
                f"protocol={self.config.protocol}, namespace={self.namespace.hex()})")

    def object_name(self, key: ChunkKey) -> str:
        """The pool object name of `key`."""
        return object_name(self.config.prefix, self.namespace, key)

    # -- SecondaryTier ------------------------------------------------------------------------
    def attach_host(self, access) -> None:
        """Move records contiguously (module docstring) if every slot of `access` keeps a
        header's room after its page-rounded payload."""
        if access.slot_bytes - -(-access.chunk_nbytes // ALIGN) * ALIGN >= HEADER_BYTES:
            self._stride = access.slot_bytes

    def lookup(self, key: ChunkKey) -> Lookup:
        """HIT if indexed; RETRY while its existence check is pending (≤ `timeout_s`); MISS
        otherwise (`probe.py`). No I/O."""
        return Lookup.MISS if self._jobs.closed else self._prober.lookup(key)

    def forget(self, keys: Sequence[ChunkKey]) -> None:
        """Drop `keys` from the index (see `SecondaryTier.forget`); each stays a miss for
        `refresh_interval_s` (an existence check meanwhile would still find an object whose
        segment owner died: the master lists it until it drops the dead client, `client_ttl`),
        and its next store removes the object before putting it (a put of a name the master
        lists returns 0 without writing a byte), also if an existence check found it again
        meanwhile (`ChunkIndex.doubted`). No I/O."""
        self._index.forget(keys)
        for key in keys:
            self._prober.mark_absent(key)

    def submit_store(self, job: TierJob) -> None:
        """Queue a store on the store lane (see `SecondaryTier.submit_store`)."""
        self._jobs.submit(self._store_pool, None, job)

    def submit_load(self, job: TierJob) -> None:
        """Queue a load on the load lane (see `SecondaryTier.submit_load`)."""
        self._jobs.submit(self._load_pool, None, job)

    def close(self) -> None:
        """Finish pending jobs (each bounded by Mooncake's RPC timeout), stop the threads,
        unregister the buffers and leave the pool (this client's segment and the objects in it
        go with it). Idempotent."""
        if not self._jobs.close():
            return
        self._pool.shutdown(wait=True)
        self._remover.shutdown(wait=True)
        self._prober.close()
        if self._pool_figures is not None:
            self._pool_figures.close()
        self._close_store()

    def _close_store(self) -> None:
        for ptr in self._registered:
            self._client.unregister_buffer(ptr)
        self._registered.clear()
        self._client.close()

    def stats(self) -> Mapping[str, Any]:
        """Counters: bytes_stored, bytes_loaded, contiguous_records (records moved as one
        buffer, module docstring), store_failed, load_failed, already_stored,
        corrupt, missing, size_mismatch, pool_full, request_errors, master_unreachable,
        removed, remove_errors (objects removed: corrupt ones, and forgotten ones before their
        store), exist_checked, exist_errors, exist_timeouts, listings and list_errors
        (`master_metrics_address`), sweeps (re-checks of every
        indexed chunk, `probe.py`) (absent while 0); plus chunks (indexed keys) and
        durability ("pool": chunks live in the pool's memory, with `replica_num` copies)."""
        return self._jobs.counters() | {"chunks": len(self._index), "durability": "pool"}

    # -- jobs ---------------------------------------------------------------------------------
    def _exist(self, keys: list[ChunkKey]) -> list[int]:
        return self._client.batch_is_exist([self.object_name(k) for k in keys])

    def _scratch_base(self) -> int:
        """Offset of this pool thread's scratch area in `_scratch` (taken on first use)."""
        base = getattr(self._local, "base", None)
        if base is None:
            with self._scratch_lock:
                slot = self._free_scratch.pop()
            base = self._local.base = slot * (MAX_BATCH * HEADER_BYTES + ALIGN)
        return base

    def _contiguous(self, job: TierJob, record: int) -> bool:
        """Whether job's record (`record` bytes) lies contiguous in the host region (module
        docstring)."""
        stride = self._stride
        return (stride is not None and job.offset >= stride and job.offset % stride == 0
                and record <= stride)

    def _header(self, job: TierJob, i: int, base: int, contiguous: bool) -> memoryview:
        """Where job `i` of a batch keeps its record header (`_buffers`)."""
        if contiguous:
            return self._host[job.offset - HEADER_BYTES:job.offset]
        return self._scratch[base + i * HEADER_BYTES:][:HEADER_BYTES]

    def _buffers(self, job: TierJob, i: int, base: int, record: int,
                 contiguous: bool) -> tuple[list[int], list[int]]:
        """(addresses, sizes) of job `i` of a batch, whose record is `record` bytes: the
        whole record in the host region (`contiguous`), else its header, its slot, its
        padding."""
        if contiguous:
            return [self._host_addr + job.offset - HEADER_BYTES], [record]
        scratch = self._registered[1]
        ptrs = [scratch + base + i * HEADER_BYTES, self._host_addr + job.offset]
        sizes = [HEADER_BYTES, job.nbytes]
        pad = record - HEADER_BYTES - job.nbytes
        if pad:
            ptrs.append(scratch + base + MAX_BATCH * HEADER_BYTES)
            sizes.append(pad)
        return ptrs, sizes

    def _master_down(self, todo: list[int], errors: list[str | None]) -> bool:
        """False if the master answers; else True, with every job of `todo` failed in
        `errors` (and counted)."""
        if self._client.health_check() == 0:
            return False
        self._jobs.count("master_unreachable", len(todo))
        for i in todo:
            errors[i] = "Mooncake master unreachable"
        return True

    def _store_batch(self, jobs: list[TierJob]) -> list[str | None]:
        errors: list[str | None] = [None] * len(jobs)
        todo: list[int] = []
        for i, job in enumerate(jobs):
            errors[i] = job_problem(job, len(self._host), self.namespace)
            if errors[i] is None and self._index.skip_store(job.key):
                self._jobs.count("already_stored")
            elif errors[i] is None:
                todo.append(i)
        if not todo:
            return errors
        if self._master_down(todo, errors):
            return errors
        todo = self._remove_stale(jobs, todo, errors)
        if not todo:
            return errors
        base = self._scratch_base()
        zeros = self._scratch[base + MAX_BATCH * HEADER_BYTES:][:ALIGN]
        zeros[:] = bytes(ALIGN)
        tally: Counter[str] = Counter()
        names, ptrs, sizes, records = [], [], [], []
        for n, i in enumerate(todo):
            job = jobs[i]
            record = record_nbytes(job.nbytes)
            contiguous = self._contiguous(job, record)
            payload = self._host[job.offset:job.offset + job.nbytes]
            encode_header(self._header(job, n, base, contiguous), job.key, job.nbytes,
                          payload_checksum(payload))
            pad = record - HEADER_BYTES - job.nbytes
            if contiguous and pad:   # the padding is the slot's own page rounding
                self._host[job.offset + job.nbytes:job.offset + job.nbytes + pad] = bytes(pad)
            tally["contiguous_records"] += contiguous
            p, s = self._buffers(job, n, base, record, contiguous)
            names.append(self.object_name(job.key))
            ptrs.append(p)
            sizes.append(s)
            records.append(record)
        codes = self._client.batch_put_from_multi_buffers(names, ptrs, sizes, self._replicate)
        stored = []
        for i, code, record in zip(todo, codes, records):
            job = jobs[i]
            if code == 0 or code == OBJECT_ALREADY_EXISTS:
                stored.append((job.key, record))
                if code == 0:
                    tally["bytes_stored"] += job.nbytes
                else:
                    tally["already_stored"] += 1
                continue
            tally["pool_full" if code == NO_AVAILABLE_HANDLE else "request_errors"] += 1
            self._puts_refused.labels("pool_full" if code == NO_AVAILABLE_HANDLE
                                      else "error").inc()
            errors[i] = f"put: {error_name(code)}"
        self._index.add_many(stored)      # ends their doubt (`forget`)
        self._prober.forget_absent([key for key, _ in stored])
        self._jobs.count_all(+tally)
        return errors

    def _remove_stale(self, jobs: list[TierJob], todo: list[int],
                      errors: list[str | None]) -> list[int]:
        """Remove the objects of the stores of `todo` whose keys were forgotten (`forget`),
        so that their puts write; returns `todo` less the stores whose removal failed (their
        error set in `errors`, counted as `remove_errors`; they stay forgotten)."""
        stale = [i for i in todo if self._index.doubted(jobs[i].key)]
        if not stale:
            return todo
        codes = self._client.batch_remove([self.object_name(jobs[i].key) for i in stale], True)
        failed = set()
        for i, code in zip(stale, codes):
            if code == 0 or code in GONE:
                continue
            failed.add(i)
            errors[i] = f"remove before put: {error_name(code)}"
        self._jobs.count_all(+Counter(removed=len(stale) - len(failed),
                                      remove_errors=len(failed)))
        return [i for i in todo if i not in failed]

    def _load_batch(self, jobs: list[TierJob]) -> list[str | None]:
        errors: list[str | None] = [job_problem(j, len(self._host), self.namespace)
                                    for j in jobs]
        todo = [i for i, e in enumerate(errors) if e is None]
        if not todo:
            return errors
        if self._master_down(todo, errors):
            return errors
        base = self._scratch_base()
        tally: Counter[str] = Counter()
        names, ptrs, sizes, contiguous = [], [], [], []
        for n, i in enumerate(todo):
            job = jobs[i]
            record = record_nbytes(job.nbytes)
            contiguous.append(self._contiguous(job, record))
            tally["contiguous_records"] += contiguous[-1]
            p, s = self._buffers(job, n, base, record, contiguous[-1])
            names.append(self.object_name(job.key))
            ptrs.append(p)
            sizes.append(s)
        codes = self._client.batch_get_into_multi_buffers(names, ptrs, sizes)
        loaded = []
        for n, (i, code) in enumerate(zip(todo, codes)):
            job = jobs[i]
            errors[i] = self._check_loaded(job, code,
                                           self._header(job, n, base, contiguous[n]))
            if errors[i] is None:
                loaded.append((job.key, code))
                tally["bytes_loaded"] += job.nbytes
        self._index.add_many(loaded)
        self._jobs.count_all(+tally)
        return errors

    def _check_loaded(self, job: TierJob, code: int, header_view: memoryview) -> str | None:
        """The outcome of one get that returned `code` into `header_view` and the job's
        slot (None: verified; the caller indexes it and counts its bytes)."""
        if code < 0:
            if code in GONE:
                self._index.discard(job.key)
                self._prober.mark_absent(job.key)
                self._jobs.count("missing")
                return f"not found: {error_name(code)}"
            size = self._client.get_size(self.object_name(job.key))
            if size >= 0 and size != record_nbytes(job.nbytes):   # the get refused the size
                if size >= HEADER_BYTES + ALIGN and size % ALIGN == 0:
                    self._jobs.count("size_mismatch")
                    return f"record of {size} bytes != expected {record_nbytes(job.nbytes)}"
                self._jobs.count("corrupt")
                self._remove_later(job.key)
                return f"corrupt: record size {size} is no record size"
            self._jobs.count("request_errors")
            return f"get: {error_name(code)}"
        dest = self._host[job.offset:job.offset + job.nbytes]
        try:
            header = checked_header(header_view, job.key, self.namespace)
            check_record_size(header, code, job.nbytes)
            verify_payload(header, dest)
        except CorruptChunk as exc:
            self._jobs.count("corrupt")
            self._remove_later(job.key)
            return f"corrupt: {exc}"
        except SizeMismatch as exc:
            self._jobs.count("size_mismatch")
            return str(exc)
        return None

    def _remove_later(self, key: ChunkKey) -> None:
        """Forget `key` now (a miss until re-checked after its removal) and remove its object
        from the pool on the remove thread."""
        self._index.discard(key)
        self._prober.mark_absent(key, hold=True)
        try:
            self._remover.submit(self._remove, key)
        except RuntimeError:  # closing: the object stays; a later load finds it corrupt
            self._prober.mark_absent(key)

    def _remove(self, key: ChunkKey) -> None:
        code = self._client.remove(self.object_name(key), True)
        self._prober.mark_absent(key)   # a check that ran before the removal saw the object
        self._jobs.count("removed" if code == 0 or code in GONE else "remove_errors")
