"""Config of the p2p tier: one entry of `secondary_tiers` with `"type": "p2p"`.

Keys:
    host (str): address the listener binds; default "127.0.0.1" (loopback only unless told
        otherwise). Also this instance's identity for peers unless `advertise_host` is set.
    advertise_host (str): the address peers reach this instance at, when `host` is a wildcard
        ("0.0.0.0", "::") or a private interface. A wildcard identity is refused: peers could
        not tell instances apart nor reach them.
    port (int in 0..65535): listener base port: the engine of data-parallel index i listens
        on `port` + i (i is 0 without data parallelism); default 0 (an ephemeral port,
        reported by `P2PTier.identity`; fixed ports are what peers' configs name).
    peers (list of "host:port"): instances to pull from. This instance's own identity may be
        listed (one config for every instance); it is skipped.
    num_threads (int > 0): pull threads (loads in flight at once); default 4.
    timeout_s (number in (0, 600]): deadline of every job and of every peer call; default 5.
    auth_key (str of >= 16 characters) | auth_key_file (path of a file holding it; surrounding
        whitespace stripped): the shared secret of the HMAC challenge. Exactly one is required.
        The key never appears in a repr, log or error message.
    max_inflight (int > 0): chunks this instance serves to peers at once (slot pins held);
        requests over it are answered "busy" at once; default 16.
    max_bytes (int > 0): only for a tier not attached to a host tier (see `P2PTier`): bytes of
        chunks it keeps to serve, LRU; default 1 GiB.
    Prefill/decode disaggregation and orchestrator-driven pulls (`orchestration.py`: the
    `kv_transfer_params` keys a router or P/D proxy sends, vLLM 0.32's protocol):
    unbound_store_timeout_s (number in (0, 3600]): seconds a prefill leg's chunks stay parked
        (pinned in the host tier) without a fetch touching them; then they are released and
        the id is refused for 60 s more; default 60 (vLLM's default).
    fetch_wait_s (number in (0, 600]): decode side: the longest a decode leg's pull waits for
        a chunk its prefiller has not stored yet (the prefill leg's arrival, queueing and
        compute; the prefiller's `arrival_timeout_s` may end it sooner); a
        chunk the prefiller will never store is refused as soon as its prefill ended;
        default 30.
    arrival_timeout_s (number in (0, 600], or null): prefill side (read by the instance a
        decoder fetches from, not by the decoder): the longest a fetch for an id this
        instance has not heard of yet waits for its prefill leg (decoder-first or concurrent
        legs: the id is heard of only when this instance's scheduler first sees the
        request, many seconds later on a loaded host). Default null: as long as the fetch
        itself waits (the decoder's `fetch_wait_s`), as vLLM's tier does. Set it to have
        fetches for ids that will never come (a prefill leg the orchestrator failed to send)
        refused sooner, at the cost of a recompute whenever a prefill leg comes later. Reaped,
        finished and given-up ids are refused at once either way.
    The orchestrator's view: a prefiller is named in a decode leg's `remote_prefiller` (and a
    peer in `remote_kv_source`) by `remote_host` = its `advertise_host` (or `host`) and
    `remote_port` = its `port` + the data-parallel index of the engine that serves the
    request, i.e. exactly that engine's `P2PTier.identity`: like vLLM's own tier, each DP
    engine of a server (one config, one `port`) listens on `port` + its index (vLLM's
    `parallel_config.data_parallel_index`, `listen_port`), so an orchestrator that sent the
    prefill leg to DP rank r (vLLM's `X-data-parallel-rank` header) names `port` + r. Give
    prefillers a fixed `port` with the next DP-size - 1 ports free too. Every instance needs
    the same `auth_key`; `peers` may stay empty (a decode leg needs no directory); a peer in
    `peers` is named by its engine's port likewise.
Errors name the key (`peers[1]: ...`); the config loader prefixes the list position.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any, Mapping

from kvhal.tier import TierError
from ..config_values import positive_int, seconds

DEFAULT_THREADS = 4
DEFAULT_TIMEOUT_S = 5.0
MAX_TIMEOUT_S = 600.0
DEFAULT_MAX_INFLIGHT = 16
DEFAULT_MAX_BYTES = 1 << 30
MIN_AUTH_KEY_CHARS = 16
_WILDCARDS = frozenset({"0.0.0.0", "::", ""})
_PASSTHROUGH = frozenset({"type", "module_path"})
_KEYS = frozenset({"host", "advertise_host", "port", "peers", "num_threads", "timeout_s",
                   "auth_key", "auth_key_file", "max_inflight", "max_bytes",
                   "unbound_store_timeout_s", "fetch_wait_s", "arrival_timeout_s"})
DEFAULT_UNBOUND_S = 60.0
MAX_UNBOUND_S = 3600.0
DEFAULT_FETCH_WAIT_S = 30.0
#: No arrival bound of its own: an unheard-of id waits as long as its fetch (vLLM's rule).
DEFAULT_ARRIVAL_S = None


@dataclass(frozen=True, slots=True)
class P2PConfig:
    """A validated p2p tier config (see module docstring). `auth_key` is left out of repr."""

    host: str
    advertise_host: str
    port: int
    peers: tuple[tuple[str, int], ...]
    num_threads: int
    timeout_s: float
    max_inflight: int
    max_bytes: int
    auth_key: bytes = field(repr=False)
    unbound_store_timeout_s: float = DEFAULT_UNBOUND_S
    fetch_wait_s: float = DEFAULT_FETCH_WAIT_S
    arrival_timeout_s: float | None = DEFAULT_ARRIVAL_S


def _host(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value or any(c.isspace() or c == "\0" for c in value):
        raise TierError(f"{name}: must be a host name or IP address, got {value!r}")
    return value


def parse_address(text: Any, name: str) -> tuple[str, int]:
    """Parse "host:port" (IPv6 as "[::1]:port").

    Raises:
        TierError: not a string of that form, or a port outside 1..65535; names `name`.
    """
    if not isinstance(text, str) or ":" not in text:
        raise TierError(f"{name}: must be \"host:port\", got {text!r}")
    host, _, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise TierError(f"{name}: port must be in 1..65535, got {text!r}")
    if host in _WILDCARDS:
        raise TierError(f"{name}: {host or 'an empty host'} is not a routable peer address")
    return _host(host, name), int(port)


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return host in _WILDCARDS


def _auth_key(config: Mapping[str, Any]) -> bytes:
    if ("auth_key" in config) == ("auth_key_file" in config):
        raise TierError("auth_key: exactly one of auth_key and auth_key_file is required "
                        "(the peers' shared secret)")
    if "auth_key_file" in config:
        path = config["auth_key_file"]
        if not isinstance(path, str) or not path:
            raise TierError(f"auth_key_file: must be a path string, got {path!r}")
        try:
            with open(path, "rb") as f:
                key = f.read(1 << 16).strip()
        except OSError as exc:
            raise TierError(f"auth_key_file: cannot read {path!r} ({exc.strerror})") from None
        where = "auth_key_file"
    else:
        value = config["auth_key"]
        if not isinstance(value, str):
            raise TierError(f"auth_key: must be a string (value not shown), got a "
                            f"{type(value).__name__}")
        key, where = value.strip().encode(), "auth_key"
    if len(key) < MIN_AUTH_KEY_CHARS:
        raise TierError(f"{where}: the key must be at least {MIN_AUTH_KEY_CHARS} characters "
                        f"(value not shown)")
    return key


def listen_port(port: int, data_parallel_index: int) -> int:
    """The port the listener binds: `port` + `data_parallel_index` (vLLM's p2p tier binds its
    base port + the engine's data-parallel index, `P2PSecondaryTierManager.__init__` in
    `vllm/v1/kv_offload/tiering/p2p/manager.py`), or 0 (ephemeral) if `port` is 0.

    Raises:
        TierError: the index is not an integer ≥ 0, or the sum exceeds 65535 (`port: ...`).
    """
    if (not isinstance(data_parallel_index, int) or isinstance(data_parallel_index, bool)
            or data_parallel_index < 0):
        raise TierError(f"port: the data-parallel index must be an integer >= 0, got "
                        f"{data_parallel_index!r}")
    if port and port + data_parallel_index > 65535:
        raise TierError(f"port: {port} + data-parallel index {data_parallel_index} = "
                        f"{port + data_parallel_index} exceeds 65535")
    return port + data_parallel_index if port else 0


def parse_config(config: Mapping[str, Any]) -> P2PConfig:
    """Validate a p2p tier config.

    Raises:
        TierError: a key is missing, unknown or has a bad value; the message starts with the
            key name (`peers[2]`, `auth_key`, ...) and states the accepted values.
    """
    unknown = sorted(str(k) for k in set(config) - _KEYS - _PASSTHROUGH)
    if unknown:
        raise TierError(f"{unknown[0]}: unknown key for the p2p tier; accepted: "
                        f"{', '.join(sorted(_KEYS))}")
    host = _host(config.get("host", "127.0.0.1"), "host")
    advertise = _host(config.get("advertise_host", host), "advertise_host")
    if _is_wildcard(advertise):
        key = "advertise_host" if "advertise_host" in config else "host"
        raise TierError(f"{key}: {advertise!r} is not a routable identity for peers; bind "
                        f"a specific address or set advertise_host")
    port = config.get("port", 0)
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise TierError(f"port: must be an integer in 0..65535 (0 = ephemeral), got {port!r}")
    peers = config.get("peers", [])
    if not isinstance(peers, (list, tuple)):
        raise TierError(f"peers: must be a list of \"host:port\" strings, got "
                        f"{type(peers).__name__}")
    parsed = tuple(parse_address(p, f"peers[{i}]") for i, p in enumerate(peers))
    timeout = seconds(config, "timeout_s", DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S)
    return P2PConfig(host, advertise, port, tuple(dict.fromkeys(parsed)),
                     positive_int(config, "num_threads", DEFAULT_THREADS), timeout,
                     positive_int(config, "max_inflight", DEFAULT_MAX_INFLIGHT),
                     positive_int(config, "max_bytes", DEFAULT_MAX_BYTES), _auth_key(config),
                     seconds(config, "unbound_store_timeout_s", DEFAULT_UNBOUND_S,
                             MAX_UNBOUND_S),
                     seconds(config, "fetch_wait_s", DEFAULT_FETCH_WAIT_S, MAX_TIMEOUT_S),
                     None if config.get("arrival_timeout_s") is None else
                     seconds(config, "arrival_timeout_s", 0.0, MAX_TIMEOUT_S))
