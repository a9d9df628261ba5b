"""The Mooncake Store client of the mooncake tier: import, setup, registration, error codes.

`mooncake.store.MooncakeDistributedStore` (PyPI `mooncake-transfer-engine-non-cuda`, the
`mooncake` extra) needs `libibverbs.so.1` (Debian `libibverbs1`) even over TCP; either missing
is one `TierError` naming what to install. Its batch calls return one int per key: bytes read
(`batch_get_into*`), 0 (`batch_put_from*` ok) or a negative `ErrorCode`
(`mooncake-store/include/types.h`; `ERROR_NAMES` below). A dead master makes calls return
RPC_FAIL after Mooncake's own RPC timeout (~4.3 s measured); the client reconnects by itself
once the master is back (its objects are gone: the master keeps metadata in memory). A TCP
transfer to a segment owner that stops answering fails after `MC_TCP_PROGRESS_TIMEOUT_SEC` /
`MC_TCP_STATUS_TIMEOUT_SEC` (Mooncake's default: 30 s); `connect` sets both to the tier's
`timeout_s` unless already set (process-wide: the first tier of a process sets them).
"""
from __future__ import annotations

import math
import os
import urllib.request
from typing import Any

import numpy as np

from kvhal.tier import TierError
from .config import MooncakeConfig

#: Mooncake `ErrorCode` values a tier meets (types.h), by value.
ERROR_NAMES = {-1: "INTERNAL_ERROR", -10: "BUFFER_OVERFLOW", -101: "SEGMENT_NOT_FOUND",
               -103: "CLIENT_NOT_FOUND", -200: "NO_AVAILABLE_HANDLE", -600: "INVALID_PARAMS",
               -700: "INVALID_WRITE", -701: "INVALID_READ", -703: "REPLICA_IS_NOT_READY",
               -704: "OBJECT_NOT_FOUND", -705: "OBJECT_ALREADY_EXISTS",
               -706: "OBJECT_HAS_LEASE", -707: "LEASE_EXPIRED", -712: "REPLICA_IS_GONE",
               -800: "TRANSFER_FAIL", -900: "RPC_FAIL"}
OBJECT_NOT_FOUND, OBJECT_ALREADY_EXISTS, NO_AVAILABLE_HANDLE = -704, -705, -200
#: Codes that mean "the object is not (or no longer) there": a miss and a removal.
GONE = frozenset({OBJECT_NOT_FOUND, -712, -710})
#: Mooncake's bounds (whole seconds) of a TCP transfer that makes no progress.
TIMEOUT_ENV = ("MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC")
INSTALL_HINT = ("pip install 'kvhal[mooncake]' (the mooncake-transfer-engine-non-cuda wheel) "
                "and apt-get install libibverbs1")


def error_name(code: int) -> str:
    """"OBJECT_NOT_FOUND (-704)" for a Mooncake return code."""
    return f"{ERROR_NAMES.get(code, 'error')} ({code})"


def store_class() -> Any:
    """`mooncake.store.MooncakeDistributedStore`, imported on first use.

    Raises:
        TierError: the package or `libibverbs.so.1` is missing (names what to install).
    """
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        missing = "libibverbs.so.1" if "libibverbs" in str(exc) else (
            exc.name or "mooncake.store")
        raise TierError(f"type: the mooncake tier needs the mooncake extra ({missing} "
                        f"missing): {INSTALL_HINT}") from None
    return MooncakeDistributedStore


def replicate_config(replica_num: int) -> Any:
    """A `mooncake.store.ReplicateConfig` keeping `replica_num` copies."""
    from mooncake.store import ReplicateConfig
    config = ReplicateConfig()
    config.replica_num = replica_num
    return config


def address(buffer: memoryview) -> int:
    """The address of a writable, C-contiguous byte buffer's first byte."""
    return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data) if len(buffer) else 0


def connect(cfg: MooncakeConfig) -> Any:
    """A set-up `MooncakeDistributedStore` client of the pool `cfg` names.

    Raises:
        TierError: the extra is missing, or setup failed (master or metadata server
            unreachable, refused segment size): names master and metadata server.
    """
    store = store_class()()
    for name in TIMEOUT_ENV:
        os.environ.setdefault(name, str(max(1, math.floor(cfg.timeout_s))))
    rc = store.setup(cfg.local_hostname, cfg.metadata_server, cfg.global_segment_size,
                     cfg.local_buffer_size, cfg.protocol, cfg.device_name,
                     cfg.master_server_address)
    if rc != 0:
        raise TierError(f"master_server_address: cannot join the Mooncake pool of master "
                        f"{cfg.master_server_address} with metadata_server "
                        f"{cfg.metadata_server!r} as {cfg.local_hostname!r} over "
                        f"{cfg.protocol} (setup returned {rc}; is mooncake_master running "
                        f"and reachable?)")
    return store


def register(store: Any, buffer: memoryview, what: str) -> int:
    """Register `buffer` with the store's transfer engine; returns its address.

    Raises:
        TierError: the engine refused it (the code is named).
    """
    ptr = address(buffer)
    rc = store.register_buffer(ptr, len(buffer))
    if rc != 0:
        raise TierError(f"{what}: Mooncake refused to register {len(buffer)} bytes "
                        f"({error_name(rc)})")
    return ptr


def list_names(address: str, timeout_s: float) -> set[str]:
    """Every object name the pool holds, from `mooncake_master`'s HTTP port at `address`
    ("host:port", its `-metrics_port`): `GET /get_all_keys`, one name per line. The master
    grants no lease for it (unlike `batch_is_exist`).

    Raises:
        OSError: the master did not answer within `timeout_s` seconds or answered an error.
    """
    with urllib.request.urlopen(f"http://{address}/get_all_keys", timeout=timeout_s) as r:
        return set(r.read().decode("utf-8", "replace").split())
