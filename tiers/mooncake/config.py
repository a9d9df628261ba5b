"""Config of the mooncake tier: one entry of `secondary_tiers` with `"type": "mooncake"`.

Keys named after Mooncake Store's own (`MooncakeDistributedStore.setup` and its config dict,
`mooncake-store/include/types.h` `CONFIG_KEY_*`):
    master_server_address (str, required): "host:port" of `mooncake_master`'s RPC port.
    metadata_server (str, required): the transfer engine's metadata service:
        "http://host:port/metadata" (the master's `-enable_http_metadata_server`, or
        `mooncake_http_metadata_server`), "etcd://host:port" or "P2PHANDSHAKE".
    local_hostname (str): the address other clients reach this one at (default "127.0.0.1";
        on a multi-node pool: this node's LAN address, never a loopback one).
    protocol ("tcp" | "rdma"): how the transfer engine moves bytes (default "tcp").
    device_name (str): RDMA devices, e.g. "mlx5_0,mlx5_1" (Mooncake's `rdma_devices`; default
        "": none, as TCP needs).
    global_segment_size (int bytes, >= 1 MiB): memory this client contributes to the pool
        (0 allowed: a client that only reads and writes others' segments; default 512 MiB).
    local_buffer_size (int bytes, >= 1 MiB): the client's transfer buffer (default 64 MiB).
    replica_num (int in [1, 16]): copies of each chunk in the pool (`ReplicateConfig`;
        default 1).
kvhal's own keys:
    prefix (str): object names start with `<prefix>/` (default "kvhal"): pools shared by
        several deployments keep them apart.
    io_threads (int in [1, 64]): threads per direction (loads and stores each; default 2).
    refresh_interval_s (number in [0.001, 86400]): how long a chunk found absent stays a miss
        before a lookup checks it again (default 1 s).
    sweep_interval_s (number in [0.001, 86400]): how often every indexed chunk is re-checked
        with one `batch_is_exist` per 1,024 keys, so that chunks the pool evicted or lost
        become misses and removals (default 300 s). Each check leases the chunk for the
        master's `default_kv_lease_ttl` (10 s by default) and the master evicts no leased
        chunk: keep it well above that lease, or the tier keeps its chunks from ever being
        evicted (`probe.py`).
    master_metrics_address (str "host:port"): `mooncake_master`'s HTTP port (its
        `-metrics_port`, 9003 by default), where it lists every object name (`/get_all_keys`)
        without leasing any. Set, the tier lists the pool every `list_interval_s` and drops
        the chunks it indexed that the listing lacks: an eviction becomes a removal within
        about `list_interval_s` instead of `sweep_interval_s` (`probe.py`). Default: unset
        (no listing). Set, the tier's `pool_used_bytes` / `pool_capacity_bytes` gauges also
        show the pool's fill as the master reports it there (`/metrics`), read every
        `refresh_interval_s`.
    list_interval_s (number in [0.001, 86400]): period of those listings (default 2 s). Each
        one moves every object name of the pool (~110 bytes each).
    timeout_s (number in [1, 3600]): bound of a TCP transfer that makes no progress (a hung
        segment owner: Mooncake's `MC_TCP_PROGRESS_TIMEOUT_SEC` / `MC_TCP_STATUS_TIMEOUT_SEC`,
        whole seconds, set from it unless already set) and of the RETRY answers while an
        existence check is pending (default 10 s). Mooncake's own RPC gives up on a dead
        master after ~4.3 s (measured), so a job ends then even if `timeout_s` is shorter.
Errors name the key (`global_segment_size: ...`); the config loader prefixes the list position.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from kvhal.tier import TierError
from ..config_values import number
from ..fs.config import MAX_REFRESH_INTERVAL_S, MIN_REFRESH_INTERVAL_S
from ..prefix import normalize_prefix

DEFAULT_SEGMENT_BYTES = 512 << 20
DEFAULT_BUFFER_BYTES = 64 << 20
MIN_POOL_BYTES = 1 << 20
#: Mooncake refuses segments above 1 TiB (`MAX_SEGMENT_SIZE`, types.h).
MAX_POOL_BYTES = 1 << 40
DEFAULT_IO_THREADS = 2
DEFAULT_REFRESH_INTERVAL_S = 1.0
DEFAULT_SWEEP_INTERVAL_S = 300.0
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_LIST_INTERVAL_S = 2.0
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 1.0, 3600.0
PROTOCOLS = ("tcp", "rdma")
_HOST_PORT_RE = re.compile(r"^(?:[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\]):(\d{1,5})$")
_HOST_RE = re.compile(r"^(?:[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(?::\d{1,5})?$")
_METADATA_RE = re.compile(r"^(?:https?|etcd)://[A-Za-z0-9.\[\]:-]+(?::\d{1,5})?(?:/\S*)?$")
_DEVICES_RE = re.compile(r"^[A-Za-z0-9_.:-]+(?:,[A-Za-z0-9_.:-]+)*$")
_KEYS = frozenset({"master_server_address", "metadata_server", "local_hostname", "protocol",
                   "device_name", "global_segment_size", "local_buffer_size", "replica_num",
                   "prefix", "io_threads", "refresh_interval_s", "sweep_interval_s",
                   "timeout_s", "master_metrics_address", "list_interval_s"})
_PASSTHROUGH = frozenset({"type", "module_path"})


@dataclass(frozen=True, slots=True)
class MooncakeConfig:
    """A validated mooncake tier config (see the module docstring for each field)."""

    master_server_address: str
    metadata_server: str
    local_hostname: str
    protocol: str
    device_name: str
    global_segment_size: int
    local_buffer_size: int
    replica_num: int
    prefix: str
    io_threads: int
    refresh_interval_s: float
    sweep_interval_s: float
    timeout_s: float
    master_metrics_address: str | None = None
    list_interval_s: float = DEFAULT_LIST_INTERVAL_S


def _string(cfg: Mapping[str, Any], name: str, default: str | None, pattern: re.Pattern,
            accepted: str) -> str:
    value = cfg.get(name, default)
    if value is None:
        raise TierError(f"{name}: required ({accepted})")
    if not isinstance(value, str) or not (pattern.match(value) or (value == "" and
                                                                    name == "device_name")):
        raise TierError(f"{name}: must be {accepted}, got {value!r}")
    return value


def _port_ok(address: str, name: str = "master_server_address") -> str:
    port = int(address.rpartition(":")[2])
    if not 1 <= port <= 65535:
        raise TierError(f"{name}: port must be in 1..65535, got {address!r}")
    return address


def parse_config(config: Mapping[str, Any]) -> MooncakeConfig:
    """Validate a mooncake tier config.

    Raises:
        TierError: a key is missing, unknown or has a bad value; the message starts with the
            key and states the accepted values.
    """
    unknown = sorted(str(k) for k in config if k not in _KEYS | _PASSTHROUGH)
    if unknown:
        raise TierError(f"{unknown[0]}: unknown key for the mooncake tier; accepted: "
                        f"{', '.join(sorted(_KEYS))}")
    protocol = config.get("protocol", "tcp")
    if protocol not in PROTOCOLS:
        raise TierError(f"protocol: must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    metadata = config.get("metadata_server")
    if metadata != "P2PHANDSHAKE":
        metadata = _string(config, "metadata_server", None, _METADATA_RE,
                           "\"http://host:port/metadata\", \"etcd://host:port\" or "
                           "\"P2PHANDSHAKE\"")
    return MooncakeConfig(
        master_server_address=_port_ok(_string(config, "master_server_address", None,
                                               _HOST_PORT_RE, "\"host:port\" of "
                                               "mooncake_master")),
        metadata_server=metadata,
        local_hostname=_string(config, "local_hostname", "127.0.0.1", _HOST_RE,
                               "a host name or address reachable by the pool's clients"),
        protocol=protocol,
        device_name=_string(config, "device_name", "", _DEVICES_RE,
                            "comma-separated RDMA device names (e.g. \"mlx5_0,mlx5_1\")"),
        global_segment_size=number(config, "global_segment_size", DEFAULT_SEGMENT_BYTES,
                                   MIN_POOL_BYTES, MAX_POOL_BYTES, integer=True,
                                   zero_ok=True),
        local_buffer_size=number(config, "local_buffer_size", DEFAULT_BUFFER_BYTES,
                                 MIN_POOL_BYTES, MAX_POOL_BYTES, integer=True),
        replica_num=number(config, "replica_num", 1, 1, 16, integer=True),
        prefix=normalize_prefix(config.get("prefix", "kvhal")) or "kvhal",
        io_threads=number(config, "io_threads", DEFAULT_IO_THREADS, 1, 64, integer=True),
        refresh_interval_s=float(number(config, "refresh_interval_s",
                                        DEFAULT_REFRESH_INTERVAL_S, MIN_REFRESH_INTERVAL_S,
                                        MAX_REFRESH_INTERVAL_S)),
        sweep_interval_s=float(number(config, "sweep_interval_s", DEFAULT_SWEEP_INTERVAL_S,
                                      MIN_REFRESH_INTERVAL_S, MAX_REFRESH_INTERVAL_S)),
        timeout_s=float(number(config, "timeout_s", DEFAULT_TIMEOUT_S, MIN_TIMEOUT_S,
                               MAX_TIMEOUT_S)),
        master_metrics_address=None if config.get("master_metrics_address") is None else
        _port_ok(_string(config, "master_metrics_address", None, _HOST_PORT_RE,
                         "\"host:port\" of mooncake_master's metrics port"),
                 "master_metrics_address"),
        list_interval_s=float(number(config, "list_interval_s", DEFAULT_LIST_INTERVAL_S,
                                     MIN_REFRESH_INTERVAL_S, MAX_REFRESH_INTERVAL_S)))
