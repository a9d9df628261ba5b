"""`fs`: the filesystem secondary tier — crash-safe, self-verifying, shared by processes.

One file per chunk (`format.py`), written to a unique temp name and renamed atomically
(`fileio.write_chunk`; with `durability: "power-loss"` also fdatasynced before the rename and
the folder fsynced after it); every load verifies header, size and the xxh3-128 payload
checksum (`fileio.read_chunk`), so a file torn or zeroed by a power loss is a miss. A failed
check, a missing file or an I/O error fails the job (a MISS for the engine), bumps a counter,
and moves a bad file into the namespace's `quarantine/` folder; nothing is raised into the
caller.

`lookup` answers from an in-memory index (`index.py`) without disk I/O. The index is built
from the directory at start (restart keeps every complete chunk; files are not rewritten) and
refreshed by a background thread, so chunks written by other processes sharing `root_dir`
become visible within `refresh_interval_s`. Loads run on `n_read_threads` threads, stores on
`n_write_threads` threads that also load while no store is queued (`jobs.LanePool`).
Capacity: `max_bytes` covers every namespace under `root_dir` (`budget.py`: namespaces nobody
uses are deleted first, then this namespace's least recently used chunks), and holds for a
namespace folder several processes share (`ledger.py`: every store, eviction and failed write
is counted in one ledger file under a lock; each refresh re-bases it); ENOSPC fails the
store and evicts about a tenth of the namespace. A store that evicts overwrites one evicted
file of its own size in place (`recycle_files`), so a full tier's stores allocate no inode and
no blocks; a load that finds its file rewritten under it reads it once more and misses.
"""
from __future__ import annotations

import errno
import os
import shutil
import threading
import time
from functools import partial
from typing import Any, Mapping

import numpy as np

from kvhal.keys import ChunkKey

from kvhal.tier import JobKind, TierError, TierJob, job_problem
from kvhal.tier_metrics import MetricSpec
from ..chunk_format import ALIGN, CorruptChunk, SizeMismatch, record_nbytes
from ..index import ChunkIndex, StoresInFlight
from ..jobs import IndexedTier, JobBoard, LanePool, internal_error
from .config import parse_config
from .direct import DirectIo, Transfer, Way
from .inflight import KeyCounts, Reservation
from .fileio import (Scratch, batchable, claim_file, file_size, fsync_dir, probe_o_direct,
                     quarantine_file, read_chunk, read_chunks, same_file, unlink_file,
                     write_chunk, write_chunks)
from .budget import RootBudget, mark_in_use
from .format import CHUNKS_DIR, QUARANTINE_DIR, chunk_path, chunk_paths, namespace_dir
from .ledger import Ledger, Usage
from .descriptions import DescriptionLogs
from .scan import chunk_file_bytes, orphaned_temp_files, scan_namespace

#: Share of the filesystem's available space used when `max_bytes` is not configured.
DEFAULT_SPACE_SHARE = 0.9
#: At most this often (seconds) the other namespaces under root_dir are measured again.
ROOT_SCAN_INTERVAL_S = 10.0
#: The refresh thread waits at least this many times as long as its last scan took.
REFRESH_DUTY_FACTOR = 20
#: Most chunks one pool thread moves in one GIL-free call of the C helper (`LanePool`: only
#: while more jobs than threads are queued).
MAX_BATCH = 8
#: errno values of a load that mean the file itself is unusable (it is quarantined).
_BAD_FILE_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EIO})
#: `_store_begin` of a chunk stored already: nothing reserved, nothing failed.
_STORED = Reservation()


def _errno_text(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, "OSError")
    return f"{name}: {exc.strerror or exc}"


class FsTier(IndexedTier):
    """The fs tier (see module docstring; config keys in `config.py`).

    Args:
        config: This tier's `secondary_tiers` entry.
        host: Writable, C-contiguous memoryview (format "B") of the host region.
        namespace: 16-byte namespace digest; files go under `root_dir/<namespace hex>/`.
        os_module: The `os` module used for chunk file I/O; tests pass a `Faulty...` wrapper
            to inject errno values.

    Raises:
        TierError: bad config, `root_dir` not creatable, writable or listable, or `o_direct: true`
            on a filesystem without O_DIRECT support.
    """

    name = "fs"
    metric_specs = (
        MetricSpec("sync_write_seconds", "histogram", "Wall time of writing one chunk file "
                   "durably (durability power-loss: write, fdatasync, rename, folder fsync; a "
                   "batch written in one call counts its mean per file), seconds"),
        MetricSpec("budget_removed_files", "counter", "Chunk files removed to keep the "
                   "namespace within max_bytes (evictions whose file was not recycled)"),
    )

    def __init__(self, config: Mapping[str, Any], host: memoryview, namespace: bytes, *,
                 os_module=os):
        cfg = parse_config(config)
        if not host.contiguous or host.itemsize != 1:
            raise TierError("host: the host region must be a C-contiguous byte memoryview")
        self.config = cfg
        self._host = host
        self._host_addr = int(np.frombuffer(host, dtype=np.uint8).ctypes.data) if len(host) else 0
        self.namespace = bytes(namespace)
        self._os = os_module
        self.ns_dir = namespace_dir(cfg.root_dir, self.namespace)
        self._make_dirs()
        supported = probe_o_direct(os.path.join(self.ns_dir, CHUNKS_DIR, "00"))
        if cfg.o_direct is True and not supported:
            raise TierError(f"o_direct: true, but the filesystem at {cfg.root_dir!r} does not "
                            "support O_DIRECT; use \"adaptive\", \"small\", "
                            "\"small-writes\", \"auto\" or false")
        #: Which transfers use O_DIRECT (`direct.py`); the three attributes after it say what
        #: `stats()` reports of it.
        self._direct_io = DirectIo(cfg.o_direct, supported)
        #: Whether every chunk file is written and read with O_DIRECT (detected at start).
        self.o_direct = self._direct_io.every
        #: Payloads below this many bytes are written / read with O_DIRECT (0: none, or every
        #: one with `o_direct`); larger ones follow `direct.RULES`.
        self.o_direct_writes_below = self._direct_io.writes_below
        self.o_direct_reads_below = self._direct_io.reads_below
        self._sync = cfg.durability == "power-loss"
        #: Whether stores overwrite files in place (`recycle_files`). Never under durability
        #: "power-loss": the rename out of a victim's folder would need that folder fsynced
        #: too, or a power loss could bring the victim's name back.
        self._recycle = cfg.recycle_files and not self._sync
        self._sync_seconds = self.metrics["sync_write_seconds"].labels()
        self._budget_removed = self.metrics["budget_removed_files"].labels()
        self._jobs = JobBoard("fs")
        self._remove_temps(orphaned_temp_files(self.ns_dir, time.time()))
        self._index = ChunkIndex()
        #: Descriptions of the chunks (`TierJob.description`), beside the chunk folders.
        self._descriptions = DescriptionLogs(self.ns_dir, self.namespace)
        #: Chunks listings found, with their descriptions, until `take_found`.
        self._found: list[tuple[ChunkKey, bytes | None]] = []
        self._found_lock = threading.Lock()
        self._scan_lock = threading.Lock()
        #: Keys of stores whose reservation has not ended, and the victims whose files they
        #: recycle: a refresh leaves their files to the store.
        self._storing = KeyCounts()
        self._budget = RootBudget(cfg.root_dir, os.path.basename(self.ns_dir))
        try:
            #: The namespace's bytes in every process sharing its folder (`ledger.py`).
            self._ledger = Ledger(self.ns_dir, partial(chunk_file_bytes, self.ns_dir))
        except OSError as exc:
            raise TierError(f"root_dir: cannot use the usage ledger of {self.ns_dir!r} "
                            f"({_errno_text(exc)})") from None
        self._next_root_scan = 0.0
        self._refresh_wait_s = cfg.refresh_interval_s
        try:
            self.refresh()
            self._descriptions.open(self._index.snapshot()[0])
        except OSError as exc:
            self._ledger.close()
            raise TierError(f"root_dir: cannot list {self.ns_dir!r} "
                            f"({_errno_text(exc)})") from None
        self.max_bytes = cfg.max_bytes or self._default_max_bytes()
        self._scratch = threading.local()
        #: Keys being loaded now: their files are never recycled meanwhile.
        self._loading = KeyCounts()
        #: Loads on `n_read_threads` threads, stores on `n_write_threads` threads that also
        #: load while no store is queued (`LanePool`).
        self._pool = LanePool((cfg.n_read_threads, cfg.n_write_threads), "kvhal-fs",
                              (partial(self._jobs.run_batch, self._load_batch),
                               partial(self._jobs.run_batch, self._store_batch)), MAX_BATCH)
        self._load_pool, self._store_pool = self._pool.lanes
        self._stop = threading.Event()
        self._refresher = threading.Thread(target=self._refresh_loop, name="kvhal-fs-refresh",
                                           daemon=True)
        self._refresher.start()

    # -- setup --------------------------------------------------------------------------------
    def _make_dirs(self) -> None:
        chunks = os.path.join(self.ns_dir, CHUNKS_DIR)
        try:
            os.makedirs(os.path.join(self.ns_dir, QUARANTINE_DIR), exist_ok=True)
            missing = [f"{i:02x}" for i in range(256)
                       if not os.path.isdir(os.path.join(chunks, f"{i:02x}"))]
            for name in missing:
                os.makedirs(os.path.join(chunks, name), exist_ok=True)
            if missing:
                fsync_dir(os, chunks)
                fsync_dir(os, self.ns_dir)
            if not os.access(os.path.join(chunks, "00"), os.W_OK):
                raise PermissionError(errno.EACCES, "not writable")
        except OSError as exc:
            raise TierError(f"root_dir: cannot use {self.config.root_dir!r} "
                            f"({_errno_text(exc)})") from None

    def _remove_temps(self, orphans: list[tuple[str, int]]) -> None:
        for path, _ in orphans:
            try:
                os.unlink(path)
                self._jobs.count("orphaned_temps_removed")
            except OSError:
                pass

    def _default_max_bytes(self) -> int:
        free = shutil.disk_usage(self.ns_dir).free
        return max(ALIGN, int(DEFAULT_SPACE_SHARE * free) + self._index.used_bytes
                   + self._budget.others_bytes)

    def _refresh_loop(self) -> None:
        wait_s = self.config.refresh_interval_s
        while not self._stop.wait(wait_s):
            t0 = time.perf_counter()
            try:
                self.refresh()
            except Exception:  # keep refreshing; the counter shows it in metrics
                self._count("refresh_errors")
            # a scan lists every file: a big folder is scanned less often, so scanning takes
            # at most 1 / REFRESH_DUTY_FACTOR of one core's time
            wait_s = self._refresh_wait_s = max(self.config.refresh_interval_s,
                                                REFRESH_DUTY_FACTOR * (time.perf_counter() - t0))

    def refresh(self) -> None:
        """Re-scan the namespace folder now (the background thread does this every
        `refresh_interval_s` or longer for big folders): mark the namespace in use (with the
        current wait, `budget.py`), index files other processes wrote, forget deleted ones,
        remove temp files of writers that died (`scan.orphaned_temp_files`); every
        `ROOT_SCAN_INTERVAL_S` also measure the other namespaces under root_dir.
        Thread-safe; scans run one at a time.

        Raises:
            OSError: a folder could not be listed; the index is left as it was (the background
                thread counts `refresh_errors` and tries again).
        """
        with self._scan_lock:
            mark_in_use(self.ns_dir, self._refresh_wait_s)
            known, epoch = self._index.snapshot()
            mark = self._ledger.mark()
            scan = scan_namespace(self.ns_dir, self.namespace, known)
            self._ledger.rebase(mark, scan.chunk_bytes, scan.found)
            storing = self._storing.snapshot()
            self._index.reconcile({key: n for key, n in scan.found.items() if key not in storing}
                                  if storing else scan.found, epoch)
            found = self._index.take_found()
            if found:
                self._descriptions.refresh()
                described = [(key, self._descriptions.get(key)) for key in found]
                with self._found_lock:
                    self._found.extend(described)
            self._descriptions.prune(self._index)
            self._remove_temps(scan.orphans)
            now = time.monotonic()
            if now >= self._next_root_scan:
                self._budget.rescan()
                self._next_root_scan = now + max(ROOT_SCAN_INTERVAL_S,
                                                 self.config.refresh_interval_s)

    # -- SecondaryTier ------------------------------------------------------------------------
    def take_found(self) -> list[tuple[ChunkKey, bytes | None]]:
        """Chunks listings found since the last call (at start: every chunk file of the
        namespace), each with the description its store recorded (`descriptions.py`; None
        for chunks stored without one or by an older kvhal). No I/O: the listing thread read
        them."""
        with self._found_lock:
            out, self._found = self._found, []
        return out

    def close(self) -> None:
        """Finish pending jobs, stop the pools and the refresh thread. Idempotent."""
        if not self._jobs.close():
            return
        self._stop.set()
        self._pool.shutdown(wait=True)
        self._refresher.join()
        self._descriptions.close()
        self._ledger.close()

    def stats(self) -> Mapping[str, Any]:
        """Counters: bytes_stored, bytes_loaded, store_failed, load_failed, corrupt, missing,
        io_errors, quarantined, evictions, files_recycled (evictions whose file a store
        overwrote in place: an evicted chunk's, or a copy of its own chunk another process
        wrote), refused_in_flight (stores failed because stores in flight held the room:
        `index.StoresInFlight`), refused_shared (stores failed because the namespace folder
        was full of chunks other processes wrote that this tier had not indexed even after
        listing it again), usage_errors (I/O errors of the usage ledger), enospc,
        orphaned_temps_removed, refresh_errors,
        namespaces_deleted (absent while 0); plus used_bytes (this tier's index),
        namespace_bytes (the namespace's chunk files and stores in flight in every process
        sharing its folder: `ledger.py`), max_bytes (root-wide),
        other_namespaces_bytes (held by other namespaces under root_dir at the last listing),
        chunks, o_direct (bool, detected at start: every read and write with O_DIRECT),
        o_direct_writes_below and o_direct_reads_below (bytes: payloads below them are
        written / read with O_DIRECT; 0 for none; "adaptive" reads larger ones with O_DIRECT
        too) and durability (the config value). Under `o_direct: "adaptive"` also
        large_writes_{o_direct,buffered} (counts of larger chunks written each way) and
        large_write_{o_direct,buffered}_gbps (each mode's measured throughput, 1e9 bytes per
        busy second over its windows of transfers, `large_io.py`; absent until measured)."""
        deleted = self._budget.namespaces_deleted
        large_writes = self._direct_io.large_writes
        rates = {} if large_writes is None else {
            f"large_write_{mode}_gbps": rate
            for mode, rate in large_writes.rates().items() if rate is not None}
        return (self._jobs.counters() | ({"namespaces_deleted": deleted} if deleted else {})
                | self._namespace_bytes()
                | {"used_bytes": self._index.used_bytes, "max_bytes": self.max_bytes,
                   "other_namespaces_bytes": self._budget.others_bytes,
                   "chunks": len(self._index), "o_direct": self.o_direct,
                   "o_direct_writes_below": self.o_direct_writes_below,
                   "o_direct_reads_below": self.o_direct_reads_below,
                   "durability": self.config.durability} | rates)

    def _namespace_bytes(self) -> dict[str, int]:
        try:
            return {"namespace_bytes": self._ledger.total()}
        except OSError:
            return {}

    # -- jobs ---------------------------------------------------------------------------------
    def _check_job(self, job: TierJob) -> str | None:
        return job_problem(job, len(self._host), self.namespace)

    @property
    def io_threads(self) -> tuple[int, int]:
        """(threads that may run loads, threads that may run stores): n_read_threads +
        n_write_threads and n_write_threads (`jobs.LanePool`: the store threads also load
        while no store is queued)."""
        cfg = self.config
        return cfg.n_read_threads + cfg.n_write_threads, cfg.n_write_threads

    def o_direct_for(self, kind: JobKind, nbytes: int) -> bool:
        """Whether a `kind` job (STORE or LOAD) of `nbytes` payload bytes whose host bytes are
        `ALIGN`-aligned moves its chunk file with O_DIRECT now (`direct.RULES`); a job at an
        unaligned host offset never does."""
        return self._direct_io.direct(kind, nbytes)

    def adaptive_for(self, nbytes: int) -> bool:
        """Whether stores of `nbytes` payload bytes at `ALIGN`-aligned host offsets pick their
        mode (buffered or O_DIRECT) by measurement (`o_direct: "adaptive"`, `large_io.py`);
        loads never do."""
        return self._direct_io.way(JobKind.STORE, nbytes) is Way.MEASURED

    def _aligned(self, job: TierJob) -> bool:
        return (self._host_addr + job.offset) % ALIGN == 0

    def _measured(self, job: TierJob) -> bool:
        """Whether `job` is a store whose mode `LargeIoMode` measures (it is written alone)."""
        return self._direct_io.way(job.kind, job.nbytes, self._aligned(job)) is Way.MEASURED

    def _direct(self, job: TierJob) -> bool:
        """Whether `job` moves its chunk file with O_DIRECT."""
        return self._direct_io.direct(job.kind, job.nbytes, self._aligned(job))

    def _ended(self, job: TierJob, transfer: Transfer, ok: bool) -> None:
        """End store `job`'s `transfer` (`DirectIo.begin`); a measured one that is `ok` counts
        in `large_writes_{o_direct,buffered}`."""
        self._direct_io.end(transfer, job.nbytes if ok else None)
        if ok and transfer.measured is not None:
            self._count(f"large_writes_{'o_direct' if transfer.direct else 'buffered'}")

    def _scratch_buffers(self) -> Scratch:
        scratch = getattr(self._scratch, "buffers", None)
        if scratch is None:
            scratch = self._scratch.buffers = Scratch(MAX_BATCH)
        return scratch

    def _batched(self, job: TierJob) -> bool:
        """Whether `job` (already checked) moves its chunk in a batch (`fileio.batchable`)."""
        return (self._os is os and job.nbytes > 0
                and batchable(self._host[job.offset:job.offset + job.nbytes]))

    def _store_batch(self, jobs: list[TierJob]) -> list[str | None]:
        """`_store` for each of `jobs` (a `LanePool` batch): the batchable ones' files are
        written in one call (`fileio.write_chunks`), the others one by one, as is a store that
        recycles an evicted file (at once: that file must not wait in a batch, where a refresh
        or a store of its key could take it meanwhile). A job whose checks raise fails alone."""
        outcomes: list[str | None] = [None] * len(jobs)
        begun: list[tuple[int, Reservation]] = []
        for i, job in enumerate(jobs):
            try:
                if self._check_job(job) or not self._batched(job) or self._measured(job):
                    outcomes[i] = self._store(job)     # alone: an adaptive one is timed alone
                    continue
                reservation = self._store_begin(job)
            except Exception as exc:  # a malformed job: its own internal error, no reservation
                outcomes[i] = internal_error(exc)
                continue
            if not reservation.nbytes:
                outcomes[i] = reservation.error
            elif reservation.reuse_path is not None:
                outcomes[i] = self._write_alone(job, reservation)
            else:
                begun.append((i, reservation))
        if not begun:
            return outcomes
        t0 = time.perf_counter()
        try:
            written = write_chunks(
                self.ns_dir, [(jobs[i].key, self._payload(jobs[i]), self._direct(jobs[i]))
                              for i, _ in begun], self._sync, self._scratch_buffers())
        except BaseException:
            for i, reservation in begun:
                self._release(jobs[i], reservation, None)
            raise
        if self._sync:
            mean = (time.perf_counter() - t0) / len(begun)
            for _ in begun:
                self._sync_seconds.observe(mean)
        for (i, reservation), error in zip(begun, written):
            outcomes[i] = self._store_end(jobs[i], reservation, error)
        return outcomes

    def _payload(self, job: TierJob) -> memoryview:
        return self._host[job.offset:job.offset + job.nbytes]

    def _store(self, job: TierJob) -> str | None:
        error = self._check_job(job)
        if error:
            return error
        reservation = self._store_begin(job)
        if not reservation.nbytes:
            return reservation.error
        return self._write_alone(job, reservation)

    def _write_alone(self, job: TierJob, reservation: Reservation) -> str | None:
        """Write the file of `job` (reserved by `_store_begin`) in a call of its own, timed for
        "adaptive", and end its reservation; returns the job's outcome."""
        transfer = self._direct_io.begin(job.kind, job.nbytes, self._aligned(job))
        error, recycled = None, False
        t0 = time.perf_counter()
        try:
            recycled = write_chunk(self._os, self.ns_dir, job.key, self._payload(job),
                                   transfer.direct, self._scratch_buffers(), self._sync,
                                   reservation.reuse_path)
            if self._sync:
                self._sync_seconds.observe(time.perf_counter() - t0)
        except OSError as exc:
            error = exc
        except BaseException:
            self._ended(job, transfer, False)
            self._release(job, reservation, None)
            raise
        self._ended(job, transfer, error is None)
        return self._store_end(job, reservation, error, recycled)

    def _store_begin(self, job: TierJob) -> Reservation:
        """The steps of a checked store before its file is written: a `Reservation` with
        nothing reserved if the chunk is already stored (no error) or cannot be (its error),
        else the record bytes reserved in the index and in the namespace's ledger, and the
        evicted file it recycles (or None); the victims it evicted are gone. The caller must
        end a reservation with `_store_end`."""
        if self._index.skip_store(job.key):
            if job.description:
                self._descriptions.append(job.key, job.description)
            return _STORED
        # an unindexed (or doubted: `forget`) file under this name is rewritten, not trusted:
        # it may be torn by a power loss (the scan left it out), or be another process's copy
        # of the same chunk
        nbytes = record_nbytes(job.nbytes)
        reservation = self._reserve(job, nbytes)
        if reservation is None:
            # the namespace is full of chunks this process has not indexed yet (other
            # processes wrote them), or its ledger counts too high (a rescan re-bases it)
            try:
                self.refresh()
            except OSError:
                self._count("refresh_errors")
            reservation = self._reserve(job, nbytes)
        if reservation is None:
            self._count("refused_shared")
            return Reservation(error=(
                f"chunk file: {nbytes} bytes do not fit in max_bytes {self.max_bytes}: the "
                "namespace folder is full of chunks this process has not indexed (other "
                f"processes share {self.ns_dir}), even after listing it again"))
        return reservation

    def _reserve(self, job: TierJob, nbytes: int) -> Reservation | None:
        """`_store_begin`'s reservation of `nbytes` for `job`, under the ledger's lock: a
        file of the job's own chunk (another process's copy, or an unindexed one) is claimed
        (`fileio.claim_file`) and recycled; this tier's least recently used chunks are evicted
        until the store fits (`_make_room`). None if it does not fit even with every chunk
        this tier indexes evicted; a `Reservation` with its error if it cannot be stored."""
        reservation = None
        try:
            budget = self._budget.room_for(self._ledger.total() + nbytes, self.max_bytes)
            held = self.max_bytes - budget
            less = f" less {held} bytes held by other namespaces in use" if held else ""
            if nbytes > budget:
                return Reservation(error=f"chunk file of {nbytes} bytes exceeds max_bytes "
                                   f"{self.max_bytes}{less}")
            with self._ledger.locked() as usage:
                try:
                    self._index.reserve_room(nbytes, budget)
                except StoresInFlight as exc:
                    self._count("refused_in_flight")
                    return Reservation(error=f"chunk file: {exc}" + (
                        f" (max_bytes {self.max_bytes}{less})" if held else ""))
                _, final, tmp = chunk_paths(self.ns_dir, job.key)
                own = self._take_own_file(usage, final, tmp)
                reuse = self._make_room(usage, nbytes, budget, tmp if own is None else None)
                if usage.total + nbytes > budget:
                    self._index.release(nbytes)
                    for claimed in (own, reuse and reuse[1]):
                        if claimed:
                            unlink_file(claimed)          # freed when it was claimed
                    return None
                usage.reserve(nbytes, job.key)
                reservation = (Reservation(nbytes, None, own) if own is not None else
                               Reservation(nbytes, *(reuse or (None, None))))
                # until the reservation ends, a refresh must not index this key's file
                # (renamed into place before the index learns of it) nor the recycled
                # victim's
                self._storing.add(reservation.keys(job.key))
        except OSError as exc:  # reading, writing or locking the ledger
            self._count("usage_errors")
            if reservation is not None:   # written back after the reservation: end it
                if reservation.reuse_path is not None:
                    unlink_file(reservation.reuse_path)
                self._release(job, reservation, None)
            return Reservation(error=f"usage ledger: {_errno_text(exc)}")
        return reservation

    def _take_own_file(self, usage: Usage, final: str, tmp: str) -> str | None:
        """Take away a file already at `final`, the chunk file path of a store (another
        process's copy of its chunk, or one this tier did not index), under the ledger's lock,
        so that the store's rename does not replace it uncounted: claimed for the store to
        recycle (renamed to the store's temp path `tmp`, returned), else (`recycle_files` off,
        or no lone regular file) unlinked. Its bytes are freed either way. None if no file was
        claimed."""
        size = file_size(final)
        if not size:
            return None
        own = claim_file(final, tmp) if self._recycle else None
        if own is not None or unlink_file(final):
            usage.free(size)
        return own

    def _make_room(self, usage: Usage, nbytes: int, budget: int,
                   tmp: str | None) -> tuple[ChunkKey, str] | None:
        """Evict this tier's least recently used chunks (under the ledger's lock) until a store
        of `nbytes` fits in `budget` with the namespace's `usage` or none is left; each file
        removed frees its bytes, one already gone (another process evicted it) frees none.
        Returns the victim whose file the store recycles (`recycle_files`, and a `tmp` path
        given), renamed to the store's temp path `tmp` (key, `tmp`), or None: the first
        victim of the store's size that no load of this tier is reading, and a lone regular
        file."""
        recycle = tmp is not None and self._recycle
        loading = self._loading.snapshot() if recycle else frozenset()
        reuse = None
        while usage.total + nbytes > budget:
            victim = self._index.pop_lru()
            if victim is None:
                break
            key, size = victim
            self._count("evictions")
            path = chunk_path(self.ns_dir, key)
            if reuse is None and recycle and size == nbytes and key not in loading:
                claimed = claim_file(path, tmp)
                if claimed:
                    usage.free(size)
                    reuse = (key, claimed)
                    continue
            if unlink_file(path):
                usage.free(size)
                self._budget_removed.inc()
        return reuse

    def _release(self, job: TierJob, reservation: Reservation, stored: ChunkKey | None) -> None:
        """End the reservation of `job`: index `stored` (its key, or None if nothing was
        stored) in the same step, then let refreshes see its key (and its victim's) again. The
        namespace's ledger moves the reserved bytes to its chunk files (stored) or gives them
        back."""
        try:
            if stored is None:
                self._ledger.release(reservation.nbytes, job.key)
            else:
                self._ledger.commit(reservation.nbytes, stored)
        except OSError:  # counted too high until the next refresh's rebase: room, not bytes
            self._count("usage_errors")
        self._index.release(reservation.nbytes, stored)
        if reservation.reuse is not None:
            # the victim's file is gone or renamed now; a refresh that listed it before, and
            # reads `_storing` after the next line, must not index it again
            self._index.discard(reservation.reuse)
        self._storing.remove(reservation.keys(job.key))

    def _store_end(self, job: TierJob, reservation: Reservation, error: OSError | None,
                   recycled: bool = False) -> str | None:
        """End the reservation of `job` (`_store_begin`) with the outcome of writing its file:
        the OSError that failed it, or None and whether an evicted file was `recycled`.
        Returns the job's outcome (None or an error string)."""
        stored = None
        try:
            if error is not None:
                if error.errno == errno.ENOSPC:
                    self._count("enospc")
                    self._evict(self._index.evict_lru(max(2 * reservation.nbytes,
                                                          self._index.used_bytes // 10)))
                return _errno_text(error)
            if recycled:
                self._count("files_recycled")
            stored = job.key
        finally:
            self._release(job, reservation, stored)  # indexed as the reservation ends
        if job.description:
            self._descriptions.append(job.key, job.description)   # the file is in place
        self._count("bytes_stored", job.nbytes)
        return None

    def _read(self, job: TierJob, path: str) -> None:
        """Read and verify the chunk file of `job` (its key's loads are registered meanwhile, so
        a store of this tier does not recycle the file under it).

        A file that fails its checks is corrupt only if `path` still names it unchanged
        (`same_file`); one that another process replaced, recycled or rewrote while it was
        read is a race: what `path` holds now is read once more, and a second race is a miss.

        Raises:
            CorruptChunk: the file at `path` is damaged (quarantine it).
            FileNotFoundError: no file, or it changed under both reads.
            SizeMismatch, OSError: from `read_chunk`.
        """
        self._loading.add((job.key,))
        dest, direct = self._payload(job), self._direct(job)
        try:
            for attempt in range(2):
                try:
                    read_chunk(self._os, path, job.key, dest, self.namespace, direct,
                               self._scratch_buffers())
                    return
                except CorruptChunk as exc:
                    if exc.file_id is None or same_file(path, exc.file_id):
                        raise
                    if attempt:
                        raise FileNotFoundError(errno.ENOENT, "rewritten while read twice",
                                                path) from None
        finally:
            self._loading.remove((job.key,))

    def _load_batch(self, jobs: list[TierJob]) -> list[str | None]:
        """`_load` for each of `jobs` (a `LanePool` batch): the batchable ones' files are read
        and verified in one call (`fileio.read_chunks`); one that fails there, and every other
        job, goes through `_load`, which reads its file again and says what failed."""
        outcomes: list[str | None] = [None] * len(jobs)
        alone = list(range(len(jobs)))     # jobs left for `_load`, in order
        batch: list[int] = []
        for i, job in enumerate(jobs):
            try:
                if not self._check_job(job) and self._batched(job):
                    batch.append(i)
            except Exception as exc:  # a malformed job fails alone
                outcomes[i] = internal_error(exc)
                alone.remove(i)
        if batch:
            batched = [jobs[i] for i in batch]
            self._loading.add(job.key for job in batched)
            try:
                verified = read_chunks([(chunk_path(self.ns_dir, job.key), job.key,
                                         self._payload(job), self._direct(job))
                                        for job in batched], self.namespace,
                                       self._scratch_buffers())
            finally:
                self._loading.remove(job.key for job in batched)
            loaded = 0
            for i, ok in zip(batch, verified):
                if ok:
                    self._index.touch(jobs[i].key)
                    loaded += jobs[i].nbytes
                    alone.remove(i)
            if loaded:
                self._count("bytes_loaded", loaded)
        for i in alone:
            outcomes[i] = self._load(jobs[i])
        return outcomes

    def _load(self, job: TierJob) -> str | None:
        error = self._check_job(job)
        if error:
            return error
        path = chunk_path(self.ns_dir, job.key)
        try:
            self._read(job, path)
        except FileNotFoundError:
            self._forget_missing(job.key, path)
            self._count("missing")
            return "not found"
        except CorruptChunk as exc:
            self._count("corrupt")
            self._quarantine(path)
            self._index.discard(job.key)
            return f"corrupt: {exc}"
        except SizeMismatch as exc:
            return str(exc)
        except OSError as exc:
            self._count("io_errors")
            if exc.errno in _BAD_FILE_ERRNOS:
                self._quarantine(path)
            # a file left in place (a transient error) stays a miss for a while instead of
            # coming back with the next refresh and failing at every step
            self._index.hold([job.key], time.monotonic() + max(1.0, self.config.refresh_interval_s))
            return _errno_text(exc)
        # touch only: a chunk evicted while this load read its open file stays evicted (its
        # file is gone); an unindexed file another process wrote arrives with the next refresh
        self._index.touch(job.key)
        self._count("bytes_loaded", job.nbytes)
        return None

    def _forget_missing(self, key: ChunkKey, path: str) -> None:
        """Discard `key`, whose file a load found missing, unless a store of it is in flight or
        has put its file there since (forgetting that chunk would leave its bytes on disk and
        out of the count, and the next store would see room that is not there). Checked and
        discarded while `_storing` holds its lock, so that no store of `key` begins in
        between."""
        def forget() -> None:
            if not os.path.lexists(path):
                self._index.discard(key)
        self._storing.unless_held(key, forget)

    # -- housekeeping -------------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        self._jobs.count(name, n)

    def _quarantine(self, path: str) -> None:
        """Move the chunk file at `path` into the quarantine folder; its bytes leave the
        namespace's ledger."""
        moved = False
        try:
            with self._ledger.locked() as usage:
                size = file_size(path)
                moved = quarantine_file(self.ns_dir, path)
                if moved:
                    usage.free(size)
        except OSError:  # the ledger: moved all the same (counted until the next rebase)
            self._count("usage_errors")
            moved = moved or quarantine_file(self.ns_dir, path)
        if moved:
            self._count("quarantined")

    def _evict(self, victims: list[tuple[ChunkKey, int]]) -> None:
        """Unlink the files of `victims` (taken out of the index) under the ledger's lock, each
        file removed freeing its bytes."""
        try:
            with self._ledger.locked() as usage:
                for key, size in victims:
                    self._count("evictions")
                    if unlink_file(chunk_path(self.ns_dir, key)):
                        usage.free(size)
                        self._budget_removed.inc()
        except OSError:  # the ledger: the files not unlinked yet come back with a refresh
            self._count("usage_errors")
