"""The S3 client of the obj tier: obstore (Rust `object_store`) behind four calls.

obstore was measured against boto3 at equal concurrency against one `moto_server` (2 MiB
objects; `kvhal bench tier --tier obj` prints both): at 4 threads 1.3-1.4x boto3's PUT and
1.4-1.5x its GET throughput (a standalone loop: ~2x), at 8 threads PUT on par and GET 1.25x,
because signing, HTTP and body handling run in Rust with the GIL released (boto3 sends bodies
from Python in 8 KiB blocks and SHA-256-signs each payload over http). Every call has a bounded
wall time: each attempt has `timeout_s / 2`; retries (5xx and 429 answers, 503 SlowDown,
refused and dropped connections: object_store's retry policy, run by kvhal for PUT, GET and
DELETE so that it can count them, by object_store for LIST pages) start only within
`timeout_s / 4` of the first attempt, after a backoff of at most `timeout_s / 8`, so a call ends
within 7/8 `timeout_s` whatever the server does.

Failures are `StoreFailure`s carrying an errno-style class, so obj and fs failures read alike
in job errors and counters: 401/403 → EACCES, 404 → ENOENT, 507 and quota codes → ENOSPC,
other HTTP errors → EIO, timeouts → ETIMEDOUT, refused connections → ECONNREFUSED, dropped or
cut-off connections → ECONNRESET. A `StoreFailure` is built from the status, the S3 error code
and the class alone: obstore's message (URLs, headers) never leaves this module, so no secret
can reach a log or an error through it.
"""
from __future__ import annotations

import re
import time
from datetime import timedelta
from typing import Any, Iterator

import obstore
from obstore import exceptions as obs_errors
from obstore.store import S3Store

from kvhal.tier import TierError
from kvhal.tier_metrics import MetricSpec
from .config import DEFAULT_REGION, StoreConfig

#: Retries per call beyond the first attempt (bounded again by the retry deadline).
MAX_RETRIES = 3
INITIAL_BACKOFF_S = 0.05
_STATUS_RE = re.compile(r"status code: (\d{3})")
_CODE_RE = re.compile(r"<Code>([A-Za-z0-9.]{1,64})</Code>")
_NO_SPACE_CODES = frozenset({"XMinioStorageFull", "QuotaExceeded", "InsufficientStorage"})
#: Markers of transport errors in obstore's debug text (Rust std::io::ErrorKind, hyper and
#: reqwest error kinds), first match wins → errno class.
_TRANSPORT = (("ConnectionRefused", "ECONNREFUSED"), ("TimedOut", "ETIMEDOUT"),
              ("kind: Timeout", "ETIMEDOUT"), ("ConnectionReset", "ECONNRESET"),
              ("ConnectionAborted", "ECONNRESET"), ("BrokenPipe", "ECONNRESET"),
              ("UnexpectedEof", "ECONNRESET"), ("IncompleteMessage", "ECONNRESET"),
              ("connection closed", "ECONNRESET"), ("kind: Body", "ECONNRESET"),
              ("kind: Decode", "ECONNRESET"), ("kind: Request", "ECONNRESET"),
              ("kind: Connect", "ECONNREFUSED"))


_OPS = ("PUT", "GET", "DELETE", "LIST")
#: The obj tier's own metrics (`ObjTier.metric_specs`), recorded by `S3Client` per call.
METRIC_SPECS = (
    MetricSpec("requests", "counter", "S3 requests (each attempt; a LIST call once) by "
               "operation and outcome (ok, exists: a PUT that found the object, or the errno "
               "class of the failure)",
               labels={"op": _OPS, "outcome": ("ok", "exists", "ENOENT", "EACCES", "ENOSPC",
                                                "EIO", "ETIMEDOUT", "ECONNREFUSED",
                                                "ECONNRESET")}),
    MetricSpec("retries", "counter", "S3 requests sent again after a failure that may pass "
               "(5xx, 429, refused or dropped connection; LIST's retries are object_store's and "
               "not counted), by operation", labels={"op": _OPS}),
    MetricSpec("request_seconds", "histogram", "Wall time of one S3 request (a LIST call: "
               "every page), seconds, by operation", labels={"op": _OPS}),
)


#: Failure classes worth another attempt (object_store's: not a timeout, which already took
#: half the call's time).
_RETRIED_ERRNOS = frozenset({"ECONNREFUSED", "ECONNRESET"})


def retryable(failure: StoreFailure) -> bool:
    """Whether another attempt may succeed: a 5xx or 429 answer, a refused or dropped
    connection (never a timeout, a 4xx or an error kvhal cannot class)."""
    if failure.status is not None:
        return failure.status >= 500 or failure.status == 429
    return failure.errno_name in _RETRIED_ERRNOS


class StoreFailure(Exception):
    """One failed store call.

    Attributes:
        op: "PUT", "GET", "DELETE" or "LIST".
        errno_name: The errno-style class (module docstring).
        status: HTTP status, or None for a transport failure.
        code: S3 error code (e.g. "SlowDown", "NoSuchBucket"), or None.
    """

    def __init__(self, op: str, errno_name: str, status: int | None = None,
                 code: str | None = None):
        self.op, self.errno_name, self.status, self.code = op, errno_name, status, code
        detail = " ".join(x for x in (f"HTTP {status}" if status else "", code or "") if x)
        super().__init__(f"{op} {detail or 'failed'} ({errno_name})")


def classify(op: str, exc: BaseException) -> StoreFailure:
    """The `StoreFailure` for an exception raised by an obstore call (see module docstring)."""
    text = str(exc)
    status_m, code_m = _STATUS_RE.search(text), _CODE_RE.search(text)
    status = int(status_m.group(1)) if status_m else None
    code = code_m.group(1) if code_m else None
    if isinstance(exc, (obs_errors.NotFoundError, FileNotFoundError)) or status == 404:
        return StoreFailure(op, "ENOENT", status or 404, code)
    if isinstance(exc, (obs_errors.PermissionDeniedError, obs_errors.UnauthenticatedError,
                        PermissionError)) or status in (401, 403):
        return StoreFailure(op, "ENOSPC" if code in _NO_SPACE_CODES else "EACCES", status, code)
    if status == 507 or code in _NO_SPACE_CODES:
        return StoreFailure(op, "ENOSPC", status, code)
    if status is not None:
        return StoreFailure(op, "EIO", status, code)
    for needle, name in _TRANSPORT:
        if needle in text:
            return StoreFailure(op, name)
    return StoreFailure(op, "EIO", None, type(exc).__name__)


def _credentials(store: StoreConfig) -> tuple[dict, object | None, str]:
    """(S3Store keyword args, credential provider or None, region) for `store`.

    Raises:
        TierError: no static keys and the AWS credential chain finds none.
    """
    import boto3  # the AWS credential chain; only needed without static keys or region

    session = boto3.session.Session() if store.access_key is None or store.region is None \
        else None
    region = store.region or (session.region_name if session else None) or DEFAULT_REGION
    if store.access_key is not None:
        kwargs = {"access_key_id": store.access_key, "secret_access_key": store.secret_key}
        if store.session_token:
            kwargs["session_token"] = store.session_token
        return kwargs, None, region
    if session.get_credentials() is None:
        raise TierError(f"store_config.access_key: no access_key/secret_key given and the AWS "
                        f"credential chain (environment, ~/.aws files, instance metadata) "
                        f"found none for {store.describe()}")
    from obstore.auth.boto3 import Boto3CredentialProvider
    return {}, Boto3CredentialProvider(session), region


class S3Client:
    """Blocking, thread-safe calls on one bucket; each ends within `timeout_s`.

    Args:
        store: Where and how (`StoreConfig`).
        timeout_s: Wall-time bound of one call, retries included.
        connections: Idle connections to keep per host (≥ the caller's concurrency).
        metrics: Where each call is counted (the tier's `TierMetrics` of `METRIC_SPECS`), or
            None.

    Raises:
        TierError: unreadable `ca_bundle` or one without a PEM certificate, or no credentials
            at all.
    """

    def __init__(self, store: StoreConfig, timeout_s: float, connections: int,
                 metrics: Any = None):
        self.store = store
        self._metrics = metrics
        self.timeout_s = timeout_s
        kwargs, provider, self.region = _credentials(store)
        attempt = timedelta(seconds=timeout_s / 2)
        client = {"timeout": attempt, "connect_timeout": attempt,
                  "pool_max_idle_per_host": str(connections)}
        if store.endpoint is not None:
            kwargs["endpoint"] = store.endpoint
            client["allow_http"] = store.endpoint.startswith("http://")
            kwargs["virtual_hosted_style_request"] = False
        if store.ca_bundle is not None:
            try:
                with open(store.ca_bundle, "rb") as f:
                    client["root_certificate"] = f.read()
            except OSError as exc:
                raise TierError(f"store_config.ca_bundle: cannot read {store.ca_bundle!r} "
                                f"({exc.strerror})") from None
        self._first_backoff_s = min(INITIAL_BACKOFF_S, timeout_s / 16)
        retry = {"max_retries": MAX_RETRIES, "retry_timeout": timedelta(seconds=timeout_s / 4),
                 "backoff": {"init_backoff": timedelta(seconds=self._first_backoff_s),
                             "max_backoff": timedelta(seconds=timeout_s / 8), "base": 2}}
        once = {"max_retries": 0, "retry_timeout": timedelta(0),
                "backoff": {"init_backoff": timedelta(0), "max_backoff": timedelta(0),
                            "base": 2}}
        #: Whether the server honours If-None-Match on PUT (off after a 501 answer).
        self.conditional_put = True
        try:
            # LIST pages retried by object_store; PUT, GET, DELETE by `_retry`
            self._lister = S3Store(store.bucket, region=self.region, client_options=client,
                                   retry_config=retry, credential_provider=provider, **kwargs)
            self._store = S3Store(store.bucket, region=self.region, client_options=client,
                                  retry_config=once, credential_provider=provider, **kwargs)
        except ValueError as exc:  # obstore checks certificates here; its text names no secret
            if store.ca_bundle is not None and "certificate" in str(exc):
                raise TierError(f"store_config.ca_bundle: {store.ca_bundle!r} holds no "
                                f"PEM-encoded certificate") from None
            raise TierError(f"store_config: obstore refused the client for "
                            f"{store.describe()} ({type(exc).__name__})") from None

    def _count(self, op: str, outcome: str, t0: float) -> None:
        if self._metrics is not None:
            self._metrics["requests"].labels(op, outcome).inc()
            self._metrics["request_seconds"].labels(op).observe(time.perf_counter() - t0)

    def _retry(self, failure: StoreFailure, started: float, attempt: int) -> bool:
        """Whether to send `failure.op` again (sleeping the backoff first): it may pass, the
        call started less than `timeout_s / 4` ago and retries are left."""
        if attempt >= MAX_RETRIES or not retryable(failure) or \
                time.monotonic() - started >= self.timeout_s / 4:
            return False
        time.sleep(min(self._first_backoff_s * 2 ** attempt, self.timeout_s / 8))
        if self._metrics is not None:
            self._metrics["retries"].labels(failure.op).inc()
        return True

    def __repr__(self) -> str:
        return f"S3Client({self.store.describe()}, region={self.region!r})"

    @property
    def obstore(self) -> S3Store:
        """The underlying obstore store (for a benchmark's raw client loop)."""
        return self._store

    def put(self, name: str, data: memoryview, overwrite: bool = False) -> bool:
        """Store `data` as object `name` unless it exists (If-None-Match: *), or in any case
        with `overwrite` (replacing an object a load found unusable). Returns True if written,
        False if an object of that name already existed (never with `overwrite`).

        Raises:
            StoreFailure: the PUT failed.
        """
        started, attempt = time.monotonic(), 0
        while True:
            t0 = time.perf_counter()
            conditional = self.conditional_put and not overwrite
            try:
                obstore.put(self._store, name, data, use_multipart=False,
                            mode="create" if conditional else "overwrite")
                self._count("PUT", "ok", t0)
                return True
            except (obs_errors.AlreadyExistsError, obs_errors.PreconditionError):
                self._count("PUT", "exists", t0)
                return False
            except obs_errors.NotSupportedError:
                failure = StoreFailure("PUT", "EIO", 501)
            except Exception as exc:  # noqa: BLE001 - every failure becomes a StoreFailure
                failure = classify("PUT", exc)
            self._count("PUT", failure.errno_name, t0)
            if failure.status == 501 and conditional:
                self.conditional_put = False     # the server has no If-None-Match: plain PUT
                continue
            if not self._retry(failure, started, attempt):
                raise failure
            attempt += 1

    def get(self, name: str) -> memoryview:
        """The whole object `name` (a read-only buffer owned by the client).

        Raises:
            StoreFailure: the GET failed (ENOENT if there is no such object).
        """
        started, attempt = time.monotonic(), 0
        while True:
            t0 = time.perf_counter()
            try:
                data = memoryview(obstore.get(self._store, name).bytes())
            except Exception as exc:  # noqa: BLE001
                failure = classify("GET", exc)
                self._count("GET", failure.errno_name, t0)
                if not self._retry(failure, started, attempt):
                    raise failure from None
                attempt += 1
                continue
            self._count("GET", "ok", t0)
            return data

    def delete(self, names: list[str]) -> None:
        """Delete objects (one bulk request per 1,000 names); absent names are fine.

        Raises:
            StoreFailure: a DELETE failed.
        """
        started, attempt = time.monotonic(), 0
        while True:
            t0 = time.perf_counter()
            try:
                obstore.delete(self._store, names)
            except Exception as exc:  # noqa: BLE001
                failure = classify("DELETE", exc)
                self._count("DELETE", failure.errno_name, t0)
                if failure.errno_name == "ENOENT":
                    return
                if not self._retry(failure, started, attempt):
                    raise failure from None
                attempt += 1
                continue
            self._count("DELETE", "ok", t0)
            return

    def list(self, prefix: str) -> Iterator[tuple[str, int, float]]:
        """(name, bytes, last-modified POSIX time) of every object whose name starts with
        `prefix`, in name order.

        Raises:
            StoreFailure: a LIST page failed (the iteration stops there).
        """
        t0 = time.perf_counter()
        try:
            for batch in obstore.list(self._lister, prefix, chunk_size=1000):
                for meta in batch:
                    yield meta["path"], meta["size"], meta["last_modified"].timestamp()
        except Exception as exc:  # noqa: BLE001
            failure = classify("LIST", exc)
            self._count("LIST", failure.errno_name, t0)
            raise failure from None
        self._count("LIST", "ok", t0)

    def list_dirs(self, prefix: str) -> list[str]:
        """The common prefixes ("folders") directly below `prefix` (ending without "/").

        Raises:
            StoreFailure: the LIST failed.
        """
        try:
            return list(obstore.list_with_delimiter(self._lister, prefix or None)
                        ["common_prefixes"])
        except Exception as exc:  # noqa: BLE001
            raise classify("LIST", exc) from None
