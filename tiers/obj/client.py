"""The S3 client of the obj tier: obstore (Rust `object_store`) behind four calls.

obstore was measured against boto3 at equal concurrency against one `moto_server` (2 MiB
objects; `kvhal bench tier --tier obj` prints both): at 4 threads 1.3-1.4x boto3's PUT and
1.4-1.5x its GET throughput (a standalone loop: ~2x), at 8 threads PUT on par and GET 1.25x,
because signing, HTTP and body handling run in Rust with the GIL released (boto3 sends bodies
from Python in 8 KiB blocks and SHA-256-signs each payload over http). Every call has a bounded
wall time: each attempt has `timeout_s / 2`; retries (5xx, 503 SlowDown, dropped connections,
timeouts of reads; object_store's retry policy) start only within `timeout_s / 4` of the first
attempt, after a backoff of at most `timeout_s / 8`, so a call ends within 7/8 `timeout_s`
whatever the server does.

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
#: `retries`: calls kvhal sent again (a conditional PUT the server does not support, resent
#: plain); object_store's own retries inside a call are not visible to kvhal (its latency is).
METRIC_SPECS = (
    MetricSpec("requests", "counter", "S3 calls by operation and outcome (ok, exists: a PUT "
               "that found the object, or the errno class of the failure)",
               labels={"op": _OPS, "outcome": ("ok", "exists", "ENOENT", "EACCES", "ENOSPC",
                                                "EIO", "ETIMEDOUT", "ECONNREFUSED",
                                                "ECONNRESET")}),
    MetricSpec("retries", "counter", "S3 calls kvhal sent again, by operation",
               labels={"op": _OPS}),
    MetricSpec("request_seconds", "histogram", "Wall time of one S3 call (object_store's "
               "retries included), seconds, by operation", labels={"op": _OPS}),
)


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
        retry = {"max_retries": MAX_RETRIES, "retry_timeout": timedelta(seconds=timeout_s / 4),
                 "backoff": {"init_backoff": timedelta(seconds=min(INITIAL_BACKOFF_S,
                                                                   timeout_s / 16)),
                             "max_backoff": timedelta(seconds=timeout_s / 8), "base": 2}}
        #: Whether the server honours If-None-Match on PUT (off after a 501 answer).
        self.conditional_put = True
        try:
            self._store = S3Store(store.bucket, region=self.region, client_options=client,
                                  retry_config=retry, credential_provider=provider, **kwargs)
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

    def _retried(self, op: str) -> None:
        if self._metrics is not None:
            self._metrics["retries"].labels(op).inc()

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
        t0 = time.perf_counter()
        try:
            obstore.put(self._store, name, data, use_multipart=False,
                        mode="create" if self.conditional_put and not overwrite
                        else "overwrite")
            self._count("PUT", "ok", t0)
            return True
        except (obs_errors.AlreadyExistsError, obs_errors.PreconditionError):
            self._count("PUT", "exists", t0)
            return False
        except obs_errors.NotSupportedError:
            self.conditional_put = False
            self._retried("PUT")
            return self.put(name, data, overwrite)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a StoreFailure
            failure = classify("PUT", exc)
        if failure.status == 501 and self.conditional_put and not overwrite:
            self.conditional_put = False
            self._retried("PUT")
            return self.put(name, data)
        self._count("PUT", failure.errno_name, t0)
        raise failure

    def get(self, name: str) -> memoryview:
        """The whole object `name` (a read-only buffer owned by the client).

        Raises:
            StoreFailure: the GET failed (ENOENT if there is no such object).
        """
        t0 = time.perf_counter()
        try:
            data = memoryview(obstore.get(self._store, name).bytes())
        except Exception as exc:  # noqa: BLE001
            failure = classify("GET", exc)
            self._count("GET", failure.errno_name, t0)
            raise failure from None
        self._count("GET", "ok", t0)
        return data

    def delete(self, names: list[str]) -> None:
        """Delete objects (one bulk request per 1,000 names); absent names are fine.

        Raises:
            StoreFailure: a DELETE failed.
        """
        t0 = time.perf_counter()
        try:
            obstore.delete(self._store, names)
        except Exception as exc:  # noqa: BLE001
            failure = classify("DELETE", exc)
            self._count("DELETE", failure.errno_name, t0)
            if failure.errno_name != "ENOENT":
                raise failure from None
            return
        self._count("DELETE", "ok", t0)

    def list(self, prefix: str) -> Iterator[tuple[str, int, float]]:
        """(name, bytes, last-modified POSIX time) of every object whose name starts with
        `prefix`, in name order.

        Raises:
            StoreFailure: a LIST page failed (the iteration stops there).
        """
        t0 = time.perf_counter()
        try:
            for batch in obstore.list(self._store, prefix, chunk_size=1000):
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
            return list(obstore.list_with_delimiter(self._store, prefix or None)
                        ["common_prefixes"])
        except Exception as exc:  # noqa: BLE001
            raise classify("LIST", exc) from None
