"""`obj`: the object-store secondary tier — KV shared by a fleet through any S3-compatible store.

Each chunk is one object holding exactly one chunk record (`kvhal.tiers.chunk_format`, the
fs tier's format) under a content-addressed name (`names.py`). A store PUTs the record with
If-None-Match: * (an existing object is success, never rewritten), except the store of a key
forgotten after a failed load (`forget`), which replaces the object; a load GETs it and verifies
header, key, size and the xxh3-128 payload checksum before reporting success. A 404, a short or
corrupt body, a wrong key or any failed request is a failed job (a miss) with a counter, never
wrong bytes reported as loaded; a corrupt object is deleted (another instance stores it again).

`lookup` answers from an in-memory index (`ChunkIndex`) without any request: it is built by a
LIST of the namespace at start and re-listed every `refresh_interval_s` on a background
thread, so objects other processes or nodes stored become hits, and objects they deleted
become misses (and removals). `max_bytes` is enforced by LRU over the index: victims leave the
index at once and are DELETEd on a background thread, off the store's request path; every key
that leaves the index is handed out once by `take_removed` (BlockRemoved events).

Loads and stores run on separate pools of `io_threads` threads, so stores never delay loads.
Every request ends within `timeout_s` (`client.py`), so jobs, `drain` and `close` are bounded
even against a server that stops answering.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Mapping

from kvhal.keys import ChunkKey

from kvhal.tier import TierError, TierJob, job_problem
from ..chunk_format import (ALIGN, HEADER_BYTES, CorruptChunk, SizeMismatch,
                            check_record_size, checked_header, encode_header,
                            payload_checksum, record_nbytes, verify_payload)
from ..index import ChunkIndex, StoresInFlight
from ..jobs import IndexedTier, JobBoard, JobPool
from .client import METRIC_SPECS, S3Client, StoreFailure
from .config import parse_config
from .names import key_from_object, namespace_prefix, object_name

_log = logging.getLogger(__name__)


#: Seconds between LIST tries while the start listing has not succeeded yet.
START_RETRY_S = 1.0


def start_error(failure: StoreFailure, describe: str) -> TierError | None:
    """The one clear error of a tier that cannot use its bucket at start; None when the
    failure is transient (a timeout, a refused or cut connection, an HTTP 5xx): the tier then
    starts with an empty index and lists again (an S3 endpoint down or slow while a server
    restarts must not keep vLLM from serving; its KV is a cache)."""
    if failure.errno_name in ("ETIMEDOUT", "ECONNREFUSED", "ECONNRESET") or (
            failure.errno_name == "EIO" and (failure.status is None or failure.status >= 500)):
        return None
    if failure.code == "NoSuchBucket" or (failure.errno_name == "ENOENT"):
        return TierError(f"store_config.bucket: {describe} does not exist ({failure})")
    if failure.errno_name == "EACCES":
        return TierError(f"store_config.access_key: access to {describe} denied ({failure}); "
                         "check access_key / secret_key / session_token or the AWS "
                         "credential chain")
    return TierError(f"store_config.endpoint_override: cannot list {describe} ({failure})")


class ObjTier(IndexedTier):
    """The obj tier (see module docstring; config keys in `config.py`).

    Args:
        config: This tier's `secondary_tiers` entry.
        host: Writable, C-contiguous memoryview (format "B") of the host region.
        namespace: 16-byte namespace digest; objects go under `<prefix>/<namespace hex>/`.

    Raises:
        TierError: bad config, or the bucket cannot be used (missing bucket, denied
            credentials, an HTTP 4xx at the start listing): one message naming bucket and
            endpoint. An endpoint that does not answer at start (refused, timed out, 5xx) is
            not an error: the tier logs a warning, starts with an empty index (misses, stores
            go on) and lists again every `START_RETRY_S` until a listing succeeds.
    """

    name = "obj"
    locality = "REMOTE"     # medium STORAGE, hit source disk (vLLM's obj tier names)
    metric_specs = METRIC_SPECS

    def __init__(self, config: Mapping[str, Any], host: memoryview, namespace: bytes):
        cfg = parse_config(config)
        if not host.contiguous or host.itemsize != 1:
            raise TierError("host: the host region must be a C-contiguous byte memoryview")
        self.config = cfg
        self._host = host
        self.namespace = bytes(namespace)
        self.ns_prefix = namespace_prefix(cfg.prefix, self.namespace)
        self.max_bytes = cfg.max_bytes
        self._client = S3Client(cfg.store, cfg.timeout_s, 2 * cfg.io_threads + 2,
                                self.metrics)
        self._jobs = JobBoard("obj")
        self._index = ChunkIndex()
        self._scan_lock = threading.Lock()
        #: Seconds a chunk whose load failed stays a miss (a bad object is not asked for
        #: again at every step; a listing brings it back after that).
        self.hold_s = max(1.0, cfg.refresh_interval_s)
        #: Set once a listing succeeded (the index holds what the bucket held then).
        self.listed = threading.Event()
        try:
            self.refresh()
        except StoreFailure as failure:
            error = start_error(failure, cfg.store.describe())
            if error is not None:
                raise error from None
            self._jobs.count("refresh_errors")
            _log.warning("obj tier: cannot list %s at start (%s); starting with an empty "
                         "index, listing again every %s s", cfg.store.describe(), failure,
                         START_RETRY_S)
        self._scratch = threading.local()
        self._load_pool = JobPool(cfg.io_threads, "kvhal-obj-load")
        self._store_pool = JobPool(cfg.io_threads, "kvhal-obj-store")
        self._deleter = JobPool(1, "kvhal-obj-delete")
        #: key → an event set once its DELETE in flight is done (`_delete_later`): a store of
        #: the key waits for it, so that the DELETE cannot remove the object it puts.
        self._deleting: dict[ChunkKey, threading.Event] = {}
        self._deleting_lock = threading.Lock()
        self._stop = threading.Event()
        self._refresher = threading.Thread(target=self._refresh_loop, name="kvhal-obj-refresh",
                                           daemon=True)
        self._refresher.start()

    def __repr__(self) -> str:
        return (f"ObjTier({self.config.store.describe()}, prefix={self.ns_prefix!r}, "
                f"max_bytes={self.max_bytes})")

    def object_name(self, key: ChunkKey) -> str:
        """The object name of `key` in the bucket."""
        return object_name(self.ns_prefix, key)

    # -- index --------------------------------------------------------------------------------
    def refresh(self) -> None:
        """LIST the namespace now (the background thread does this every
        `refresh_interval_s`): index objects other instances stored (oldest first, so they are
        evicted first), forget objects that are gone. Objects whose size is no record size are
        not indexed. Thread-safe; listings run one at a time.

        Raises:
            StoreFailure: a LIST request failed; the index is left as it was.
        """
        with self._scan_lock:
            _, epoch = self._index.snapshot()
            listed = []
            for name, size, mtime in self._client.list(self.ns_prefix):
                key = key_from_object(self.ns_prefix, self.namespace, name)
                if key is not None and size >= HEADER_BYTES + ALIGN and size % ALIGN == 0:
                    listed.append((mtime, name, key, size))
            listed.sort()
            self._index.reconcile({key: size for _, _, key, size in listed}, epoch)
            self.listed.set()

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.config.refresh_interval_s if self.listed.is_set()
                                  else min(START_RETRY_S, self.config.refresh_interval_s)):
            first = not self.listed.is_set()
            try:
                self.refresh()
            except StoreFailure as failure:  # keep the index; try again next interval
                self._jobs.count("refresh_errors")
                _log.debug("obj tier %s: refresh failed: %s", self.ns_prefix, failure)
                continue
            if first:
                _log.warning("obj tier: %s listed after a failed start listing (%d chunks)",
                             self.config.store.describe(), len(self._index))

    # -- SecondaryTier ------------------------------------------------------------------------
    def close(self) -> None:
        """Finish pending jobs and deletes (each bounded by `timeout_s`), stop the pools and
        the refresh thread. Idempotent."""
        if not self._jobs.close():
            return
        self._stop.set()
        self._load_pool.shutdown(wait=True)
        self._store_pool.shutdown(wait=True)
        self._deleter.shutdown(wait=True)
        self._refresher.join(self.config.timeout_s + 1.0)

    def stats(self) -> Mapping[str, Any]:
        """Counters: bytes_stored, bytes_loaded, store_failed, load_failed, already_stored,
        corrupt, missing, request_errors, evictions, refused_in_flight (stores failed because
        stores in flight held the room: `index.StoresInFlight`), deleted, delete_errors,
        refresh_errors (absent while 0); plus used_bytes, max_bytes, chunks, listed (whether a
        listing succeeded since start) and conditional_put (whether the server honours
        If-None-Match)."""
        return self._jobs.counters() | {"used_bytes": self._index.used_bytes,
                                        "max_bytes": self.max_bytes, "chunks": len(self._index),
                                        "listed": self.listed.is_set(),
                                        "conditional_put": self._client.conditional_put}

    # -- jobs ---------------------------------------------------------------------------------
    def _record_buffer(self, nbytes: int) -> memoryview:
        """This thread's scratch buffer of exactly `record_nbytes(nbytes)` bytes."""
        size = record_nbytes(nbytes)
        buf = getattr(self._scratch, "buf", None)
        if buf is None or len(buf) < size:
            buf = self._scratch.buf = memoryview(bytearray(size))
        return buf[:size]

    def _store(self, job: TierJob) -> str | None:
        error = job_problem(job, len(self._host), self.namespace)
        if error:
            return error
        if self._index.skip_store(job.key):
            return None
        overwrite = self._index.doubted(job.key)
        with self._deleting_lock:
            deleting = self._deleting.get(job.key)
        if deleting is not None and not deleting.wait(self.config.timeout_s + 1.0):
            return "a DELETE of an earlier copy is still in flight"
        nbytes = record_nbytes(job.nbytes)
        try:
            victims = self._index.reserve(nbytes, self.max_bytes)
        except StoresInFlight as exc:
            self._jobs.count("refused_in_flight")
            return f"chunk record: {exc}"
        if victims is None:
            return f"chunk record of {nbytes} bytes exceeds max_bytes {self.max_bytes}"
        if victims:
            self._jobs.count("evictions", len(victims))
            self._delete_later([key for key, _ in victims])
        stored = None
        try:
            payload = self._host[job.offset:job.offset + job.nbytes]
            record = self._record_buffer(job.nbytes)
            encode_header(record[:HEADER_BYTES], job.key, job.nbytes, payload_checksum(payload))
            record[HEADER_BYTES:HEADER_BYTES + job.nbytes] = payload
            record[HEADER_BYTES + job.nbytes:] = bytes(len(record) - HEADER_BYTES - job.nbytes)
            written = self._client.put(self.object_name(job.key), record, overwrite=overwrite)
            stored = job.key
        except StoreFailure as failure:
            self._jobs.count("request_errors")
            return str(failure)
        finally:
            self._index.release(nbytes, stored)      # indexed as the reservation ends
        self._jobs.count("bytes_stored" if written else "already_stored",
                         job.nbytes if written else 1)
        return None

    def _load(self, job: TierJob) -> str | None:
        error = job_problem(job, len(self._host), self.namespace)
        if error:
            return error
        try:
            body = self._client.get(self.object_name(job.key))
        except StoreFailure as failure:
            if failure.errno_name == "ENOENT":
                self._index.discard(job.key)
                self._jobs.count("missing")
                return f"not found: {failure}"
            self._jobs.count("request_errors")
            self._index.hold([job.key], time.monotonic() + self.hold_s)
            return str(failure)
        dest = self._host[job.offset:job.offset + job.nbytes]
        try:
            header = checked_header(body[:HEADER_BYTES], job.key, self.namespace)
            check_record_size(header, len(body), job.nbytes)
            dest[:] = body[HEADER_BYTES:HEADER_BYTES + job.nbytes]
            verify_payload(header, dest)
        except CorruptChunk as exc:
            self._jobs.count("corrupt")
            self._index.discard(job.key)
            self._delete_later([job.key])
            return f"corrupt: {exc}"
        except SizeMismatch as exc:
            self._index.hold([job.key], time.monotonic() + self.hold_s)
            return str(exc)
        self._index.touch(job.key)
        self._jobs.count("bytes_loaded", job.nbytes)
        return None

    # -- deletes (off the request path) -------------------------------------------------------
    def _delete_later(self, keys: list[ChunkKey]) -> None:
        """Forget `keys` now and DELETE their objects on the delete thread. Until a DELETE is
        done its key is filtered out of listings, and after it the key is discarded again, so a
        listing that saw the object before it went cannot bring the key back."""
        self._index.hold(keys, math.inf)
        done = threading.Event()
        with self._deleting_lock:
            for key in keys:
                self._deleting[key] = done
        try:
            self._deleter.submit(self._delete, keys, done)
        except RuntimeError:  # closing: the objects stay; a later instance evicts them
            self._done_deleting(keys, done)

    def _delete(self, keys: list[ChunkKey], done: threading.Event) -> None:
        try:
            self._client.delete([self.object_name(k) for k in keys])
            self._jobs.count("deleted", len(keys))
        except StoreFailure as failure:
            self._jobs.count("delete_errors", len(keys))
            _log.debug("obj tier %s: delete failed: %s", self.ns_prefix, failure)
        self._done_deleting(keys, done)

    def _done_deleting(self, keys: list[ChunkKey], done: threading.Event) -> None:
        self._index.unhold(keys)
        with self._deleting_lock:
            for key in keys:
                if self._deleting.get(key) is done:
                    del self._deleting[key]
        done.set()
