"""Config of the obj tier: one entry of `secondary_tiers` with `"type": "obj"`.

Keys compatible with vLLM 0.32's obj tier (`vllm/v1/kv_offload/tiering/obj/config.py`:
`ObjStoreConfig`, and the manager's `prefix`, `io_threads`):
    store_config (object, required):
        bucket (str, required): S3 bucket name (3-63 characters of a-z 0-9 . -).
        endpoint_override (str): "host:port" or "scheme://host[:port]" of an S3-compatible
            server (MinIO, Ceph RGW, moto). Default: AWS S3 of `region`.
        scheme ("http" | "https"): used with an endpoint_override without a scheme
            (default "http", as vLLM); AWS S3 is always https.
        region (str): default: the AWS chain's region (AWS_REGION, ~/.aws/config), else
            us-east-1.
        access_key, secret_key, session_token (str): static credentials. When access_key and
            secret_key are absent or empty, the standard AWS credential chain (environment,
            shared credentials and config files, SSO, container and instance metadata) is used.
            Never shown in repr, logs or errors.
        ca_bundle (str): path of a PEM file of extra root certificates for https.
    prefix (str): object names start with `<prefix>/`; default "" (none).
    io_threads (int > 0): concurrent requests per direction (loads and stores each; default 4).
kvhal's own keys:
    max_bytes (int > 0): stored bytes per namespace (record headers included); least recently
        used objects are deleted beyond it (default 100 GiB).
    refresh_interval_s (number in [0.001, 86400]): how often the index re-lists the bucket to
        pick up objects other instances stored or deleted (default 5 s).
    timeout_s (number in [0.05, 3600]): wall-time bound of one job, retries included
        (default 20 s).
Errors name the key path (`store_config.bucket: ...`); the config loader prefixes the list
position. Values of secret keys never appear in error messages.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from kvhal.tier import TierError
from ..config_values import number
from ..fs.config import MAX_REFRESH_INTERVAL_S, MIN_REFRESH_INTERVAL_S
from ..prefix import normalize_prefix

DEFAULT_IO_THREADS = 4
DEFAULT_MAX_BYTES = 100 << 30
DEFAULT_REFRESH_INTERVAL_S = 5.0
DEFAULT_TIMEOUT_S = 20.0
#: Bounds of `timeout_s`: below 50 ms a healthy loopback request of a 2 MiB chunk may not
#: finish; above an hour a hung server would hold a job (and `close`) that long.
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 0.05, 3600.0
DEFAULT_REGION = "us-east-1"
SECRET_KEYS = frozenset({"access_key", "secret_key", "session_token"})
_STORE_KEYS = ("bucket", "endpoint_override", "scheme", "region", "access_key", "secret_key",
               "session_token", "ca_bundle")
_KEYS = frozenset({"store_config", "prefix", "io_threads", "max_bytes", "refresh_interval_s",
                   "timeout_s"})
_PASSTHROUGH = frozenset({"type", "module_path"})
#: S3 bucket naming rules (AWS "Bucket naming rules"; MinIO and Ceph follow them).
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_HOST_RE = re.compile(r"^[A-Za-z0-9.-]+(:\d{1,5})?$|^\[[0-9A-Fa-f:.]+\](:\d{1,5})?$")
#: Region names: AWS's ("eu-west-1"), MinIO's and Ceph's ("default", "us_east") alike.
_REGION_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Where the objects live and how to authenticate; secrets are hidden from `repr`.

    Attributes:
        bucket: Bucket name.
        endpoint: "scheme://host[:port]" of the server, or None for AWS S3 of `region`.
        region: Region name, or None to take the AWS chain's (else `DEFAULT_REGION`).
        access_key, secret_key, session_token: Static credentials or None (AWS chain).
        ca_bundle: Path of a PEM file of extra trusted roots, or None.
    """

    bucket: str
    endpoint: str | None
    region: str | None
    access_key: str | None = field(default=None, repr=False)
    secret_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    ca_bundle: str | None = None

    def describe(self) -> str:
        """"bucket 'b' at endpoint http://h:p" for messages (no secrets)."""
        return f"bucket {self.bucket!r} at endpoint {self.endpoint or 'AWS S3'}"


@dataclass(frozen=True, slots=True)
class ObjConfig:
    """A validated obj tier config (see module docstring); `prefix` has no surrounding "/"."""

    store: StoreConfig
    prefix: str
    io_threads: int
    max_bytes: int
    refresh_interval_s: float
    timeout_s: float


def _optional_str(cfg: Mapping[str, Any], name: str) -> str | None:
    """A string value, None when absent or "" (vLLM's "not set")."""
    value = cfg.get(name)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        shown = "" if name in SECRET_KEYS else f", got {value!r}"
        raise TierError(f"store_config.{name}: must be a string{shown}")
    return value


def _shown(endpoint: str) -> str:
    """`endpoint` for an error message: any "user:password@" part (a credential) masked."""
    scheme, sep, rest = endpoint.rpartition("://")
    return f"{scheme}{sep}***@{rest.rpartition('@')[2]}" if "@" in rest else endpoint


def _endpoint(store: Mapping[str, Any]) -> str | None:
    endpoint = _optional_str(store, "endpoint_override")
    scheme = _optional_str(store, "scheme")
    if scheme is not None and scheme not in ("http", "https"):
        raise TierError(f"store_config.scheme: must be \"http\" or \"https\", got {scheme!r}")
    if endpoint is None:
        if scheme == "http":
            raise TierError("store_config.scheme: \"http\" needs an endpoint_override (AWS S3 "
                            "is https only)")
        return None
    given, sep, host = endpoint.partition("://")
    if sep:
        if given not in ("http", "https"):
            raise TierError(f"store_config.endpoint_override: scheme must be http or https, "
                            f"got {_shown(endpoint)!r}")
        if scheme is not None and scheme != given:
            raise TierError(f"store_config.scheme: {scheme!r} contradicts endpoint_override "
                            f"{_shown(endpoint)!r}")
        scheme = given
    else:
        host = endpoint
    host = host.rstrip("/")
    port = host.rpartition("]")[2].rpartition(":")[2] if ":" in host.rpartition("]")[2] else ""
    if not _HOST_RE.match(host) or (port and not 1 <= int(port) <= 65535):
        raise TierError(f"store_config.endpoint_override: must be host[:port] or "
                        f"scheme://host[:port] with a port in 1..65535, got {_shown(endpoint)!r}")
    return f"{scheme or 'http'}://{host}"


def _store_config(store: Any) -> StoreConfig:
    if not isinstance(store, Mapping):
        raise TierError(f"store_config: required object with at least \"bucket\"; got "
                        f"{type(store).__name__}")
    unknown = sorted(str(k) for k in store if k not in _STORE_KEYS)
    if unknown:
        raise TierError(f"store_config.{unknown[0]}: unknown key; accepted: "
                        f"{', '.join(_STORE_KEYS)}")
    bucket = store.get("bucket")
    if not isinstance(bucket, str) or not _BUCKET_RE.match(bucket) or ".." in bucket:
        raise TierError(f"store_config.bucket: required, 3-63 characters of a-z 0-9 . - "
                        f"starting and ending with a letter or digit; got {bucket!r}")
    access_key, secret_key = _optional_str(store, "access_key"), _optional_str(store,
                                                                               "secret_key")
    if (access_key is None) != (secret_key is None):
        missing = "secret_key" if secret_key is None else "access_key"
        raise TierError(f"store_config.{missing}: access_key and secret_key go together "
                        "(give both, or neither to use the AWS credential chain)")
    region = _optional_str(store, "region")
    if region is not None and not _REGION_RE.match(region):
        raise TierError(f"store_config.region: 1-64 letters, digits and _.- expected, got "
                        f"{region!r}")
    return StoreConfig(bucket, _endpoint(store), region, access_key,
                       secret_key, _optional_str(store, "session_token"),
                       _optional_str(store, "ca_bundle"))


def parse_config(config: Mapping[str, Any]) -> ObjConfig:
    """Validate an obj tier config.

    Raises:
        TierError: a key is missing, unknown or has a bad value; the message starts with the
            key path (e.g. "store_config.bucket") and states the accepted values. Secret values
            are never quoted.
    """
    unknown = sorted(str(k) for k in config if k not in _KEYS | _PASSTHROUGH)
    if unknown:
        raise TierError(f"{unknown[0]}: unknown key for the obj tier; accepted: "
                        f"{', '.join(sorted(_KEYS))}")
    return ObjConfig(
        store=_store_config(config.get("store_config")),
        prefix=normalize_prefix(config.get("prefix", "")),
        io_threads=number(config, "io_threads", DEFAULT_IO_THREADS, 1, 1024, integer=True),
        max_bytes=number(config, "max_bytes", DEFAULT_MAX_BYTES, 1, 1 << 62, integer=True),
        refresh_interval_s=float(number(config, "refresh_interval_s",
                                        DEFAULT_REFRESH_INTERVAL_S, MIN_REFRESH_INTERVAL_S,
                                        MAX_REFRESH_INTERVAL_S)),
        timeout_s=float(number(config, "timeout_s", DEFAULT_TIMEOUT_S, MIN_TIMEOUT_S,
                               MAX_TIMEOUT_S)))
