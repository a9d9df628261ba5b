"""How the tier conformance suite builds, damages and breaks each secondary tier.

A `TierHarness` tells the suite what a tier type can do (persist across restarts, share one
store between processes) and how to damage its stored chunks or inject I/O errors. A tier
joins the suite with one line, e.g. in its own conftest.py:

    register_harness(TierHarness("obj", config=lambda tmp, max_bytes: {...}, ...))

and is selected with `pytest conformance/ --kvhal-tier=obj` (default: every registered
harness whose tier type is registered with kvhal). Tests that need a capability a harness does
not declare are skipped with the harness's reason.
"""
from __future__ import annotations

import contextlib
import errno
import importlib
import os
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator

from kvhal import plugins
from kvhal.keys import ChunkKey
from kvhal.tier import SecondaryTier

from . import mooncake, p2p

#: Damage kinds of `TierHarness.damage`: flip one payload bit, flip one header bit (fs-like
#: tiers with a header), cut the stored object short, delete it.
DAMAGE_KINDS = ("bitflip-payload", "bitflip-header", "truncate", "delete")
#: errno values `TierHarness.faulty` must be able to inject.
FAULT_ERRNOS = (errno.EACCES, errno.ENOSPC, errno.EIO)

Config = dict[str, Any]
#: damage(tier, config, key, kind, seed): damage the stored chunk of `key` (tier open).
Damage = Callable[[SecondaryTier, Config, ChunkKey, str, int], None]
#: faulty(tmp_dir, err, direction, host, namespace): a context manager yielding a tier whose
#: `direction` ("store" or "load") I/O fails with `err` (jobs for that direction only).
Faulty = Callable[[str, int, str, memoryview, bytes], ContextManager[SecondaryTier]]
#: services(tmp_dir, namespace): a context manager running what instances storing under
#: `tmp_dir` need beyond themselves for chunks to outlive them (p2p: the keeper peer process).
Services = Callable[[str, bytes], ContextManager[Any]]
#: settle(tier, config, key, nbytes): make a chunk stored ok through `tier` outlive it.
Settle = Callable[[SecondaryTier, Config, ChunkKey, int], None]


@dataclass(frozen=True)
class TierHarness:
    """What the suite needs to know about one tier type.

    Attributes:
        name: The registered tier type (`kvhal.plugins.tiers()` key).
        config: `config(tmp_dir, max_bytes)` → this tier's config dict, storing under
            `tmp_dir` (a fresh folder per test). Must set any polling interval small (≤ 0.1 s)
            so that other processes' chunks become visible quickly.
        persistent: Chunks survive `close()` and a new instance on the same config (once
            settled, with `services` running, where the harness has them).
        shared_by_processes: Instances in separate processes with the same config see each
            other's chunks (likewise).
        services: Runs what `persistent` and `shared_by_processes` rely on (see `Services`;
            the `shared_store` fixture enters it), or None.
        settle: Called after a store that must outlive its instance (see `Settle`), or None.
        ready: `ready(tier)` waits until a new instance sees the chunks others hold, or None.
        damage: Damages a stored chunk (see `Damage`), or None.
        damage_kinds: The `DAMAGE_KINDS` `damage` supports.
        faulty: Builds a tier with injected I/O errors (see `Faulty`), or None.
        stored_objects: `stored_objects(config)` → (complete objects, temp objects) currently
            in the store (e.g. chunk files and temp files), or None.
        kill_points: SIGKILL points of the torn-chunk test (each starts a writer process).
        extra: (kvhal extra, module) where the tier needs an extra: tests of the tier skip,
            naming the extra, when the module does not import; None: no extra needed.
        own_capacity: The tier enforces `max_bytes` itself, least recently used first; False
            where the store it fronts evicts by its own policy (Mooncake's master).
        why_not: Reason printed when a test is skipped for a missing capability.
    """

    name: str
    config: Callable[[str, int], Config]
    persistent: bool = False
    shared_by_processes: bool = False
    damage: Damage | None = None
    damage_kinds: tuple[str, ...] = ()
    faulty: Faulty | None = None
    stored_objects: Callable[[Config], tuple[list[str], list[str]]] | None = None
    kill_points: int = 100
    own_capacity: bool = True
    services: Services | None = None
    settle: Settle | None = None
    ready: Callable[[SecondaryTier], None] | None = None
    extra: tuple[str, str] | None = None
    why_not: str = ""

    def missing_extra(self) -> str | None:
        """Why this tier cannot run here (its `extra` does not import), or None."""
        if self.extra is None:
            return None
        extra, module = self.extra
        try:
            importlib.import_module(module)
        except ImportError as exc:
            return (f"the {self.name} tier needs the {extra} extra ({exc.name} missing): "
                    f"pip install 'kvhal[{extra}]'")
        return None

    def make(self, config: Config, host: memoryview, namespace: bytes) -> SecondaryTier:
        """Construct the tier through its registered factory (and wait until it is `ready`)."""
        tier = plugins.tiers()[self.name].factory(config, host, namespace)
        if self.ready is not None:
            try:
                self.ready(tier)
            except BaseException:
                tier.close()
                raise
        return tier

    def after_store(self, tier: SecondaryTier, config: Config, key: ChunkKey,
                    nbytes: int) -> None:
        """Call after a store job that must outlive `tier`: `settle`s it where the harness
        has to."""
        if self.settle is not None:
            self.settle(tier, config, key, nbytes)


_HARNESSES: dict[str, TierHarness] = {}


def register_harness(harness: TierHarness) -> None:
    """Add (or replace) the harness of `harness.name`."""
    _HARNESSES[harness.name] = harness


def harnesses() -> dict[str, TierHarness]:
    """Every registered harness, by tier name."""
    return dict(_HARNESSES)


class FaultyOs:
    """The `os` module, except that the calls named in `calls` raise `OSError(err)`.

    Used where a real component cannot produce the error on demand: EIO (no faulty disk in
    CI), EACCES (CI runs as root, and root ignores permission bits), ENOSPC on loads and
    where no tiny tmpfs can be mounted. `raised` counts the injected errors. It switches the
    fs tier's C I/O path off (that path runs only with the real `os`): the same errors are
    injected into the C path by `tests/tiers/test_fs_c_path.py`, under strace.
    """

    def __init__(self, err: int, calls: tuple[str, ...]):
        self.err = err
        self.calls = frozenset(calls)
        self.raised = 0

    def __getattr__(self, name: str):
        real = getattr(os, name)
        if name not in self.calls:
            return real

        def fail(*args, **kwargs):
            self.raised += 1
            raise OSError(self.err, os.strerror(self.err))
        return fail


# -- memory ---------------------------------------------------------------------------------
def _memory_damage(tier, config, key, kind, seed):
    del tier._data[key]  # the example tier holds bytes in a private dict: deletion only


register_harness(TierHarness(
    "memory", config=lambda tmp, max_bytes: {"type": "memory", "max_bytes": max_bytes},
    damage=_memory_damage, damage_kinds=("delete",),
    why_not="the memory tier lives in one process's memory and does no I/O"))


# -- fs -------------------------------------------------------------------------------------
def _fs_config(tmp: str, max_bytes: int) -> Config:
    return {"type": "fs", "root_dir": os.path.join(tmp, "fs"), "max_bytes": max_bytes,
            "refresh_interval_s": 0.02}


def _fs_damage(tier, config, key, kind, seed):
    from kvhal.tiers.chunk_format import HEADER_BYTES, decode_header
    from kvhal.tiers.fs.format import chunk_path
    path = chunk_path(tier.ns_dir, key)
    if kind == "delete":
        os.unlink(path)
        return
    size = os.path.getsize(path)
    rng = __import__("random").Random(seed)
    if kind == "truncate":
        os.truncate(path, rng.randrange(size))
        return
    lo, hi = (0, 64) if kind == "bitflip-header" else (HEADER_BYTES, size)
    if kind == "bitflip-payload":  # within the payload proper, not the zero padding
        with open(path, "rb") as f:
            hi = HEADER_BYTES + decode_header(f.read(HEADER_BYTES)).payload_nbytes
    pos = rng.randrange(lo, hi)
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ (1 << rng.randrange(8))]))
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def _tiny_tmpfs(nbytes: int) -> Iterator[str | None]:
    """A fresh tmpfs of `nbytes` mounted on a temp folder, or None where mounting is not
    permitted (not root, or no CAP_SYS_ADMIN in this container)."""
    mnt = tempfile.mkdtemp(prefix="kvhal-tmpfs-")
    ok = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={nbytes}", "tmpfs", mnt],
        capture_output=True).returncode == 0
    try:
        yield mnt if ok else None
    finally:
        if ok:
            subprocess.run(["umount", "-l", mnt], capture_output=True)
        os.rmdir(mnt)


@contextlib.contextmanager
def _fs_faulty(tmp, err, direction, host, namespace):
    from kvhal.tiers.fs import FsTier
    calls = ("pwritev",) if direction == "store" else ("preadv",)
    if err == errno.ENOSPC and direction == "store":
        # Real ENOSPC: a 256 KiB tmpfs cannot hold the suite's 1 MiB chunk.
        with _tiny_tmpfs(256 << 10) as mnt:
            config = _fs_config(mnt or tmp, 1 << 30)
            tier = FsTier(config, host, namespace, os_module=os if mnt else FaultyOs(err, calls))
            try:
                yield tier
            finally:
                tier.close()
        return
    tier = FsTier(_fs_config(tmp, 1 << 30), host, namespace, os_module=FaultyOs(err, calls))
    try:
        yield tier
    finally:
        tier.close()


def _fs_stored_objects(config: Config) -> tuple[list[str], list[str]]:
    from kvhal.tiers.fs.format import TEMP_SUFFIX
    chunks, temps = [], []
    for dirpath, _, filenames in os.walk(config["root_dir"]):
        if "chunks" in dirpath.split(os.sep):
            for name in filenames:
                (temps if name.endswith(TEMP_SUFFIX) else chunks).append(
                    os.path.join(dirpath, name))
    return chunks, temps


register_harness(TierHarness(
    "fs", config=_fs_config, persistent=True, shared_by_processes=True,
    damage=_fs_damage, damage_kinds=DAMAGE_KINDS, faulty=_fs_faulty,
    stored_objects=_fs_stored_objects))


# -- obj ------------------------------------------------------------------------------------
#: HTTP answers that stand for the injected errno values (`kvhal.tiers.obj.client` maps them
#: back): denied, out of space (MinIO's code), internal error.
OBJ_FAULT_STATUS = {errno.EACCES: (403, "AccessDenied"), errno.ENOSPC: (507, "XMinioStorageFull"),
                    errno.EIO: (500, "InternalError")}


def _obj_config(tmp: str, max_bytes: int) -> Config:
    import hashlib
    from .s3 import shared_server, store_config
    return {"type": "obj", "store_config": store_config(shared_server().endpoint),
            "prefix": "conformance/" + hashlib.sha256(tmp.encode()).hexdigest()[:16],
            "max_bytes": max_bytes, "refresh_interval_s": 0.02, "timeout_s": 10.0}


def _obj_raw_client(tier):
    from kvhal.tiers.obj.client import S3Client
    return S3Client(tier.config.store, 10.0, 2)


def _obj_damage(tier, config, key, kind, seed):
    from kvhal.tiers.chunk_format import HEADER_BYTES, decode_header
    client, name = _obj_raw_client(tier), tier.object_name(key)
    record = bytearray(client.get(name))
    client.delete([name])
    if kind == "delete":
        return
    rng = __import__("random").Random(seed)
    if kind == "truncate":
        record = record[:rng.randrange(len(record))]
    else:
        lo, hi = (0, 64) if kind == "bitflip-header" else (
            HEADER_BYTES, HEADER_BYTES + decode_header(record[:HEADER_BYTES]).payload_nbytes)
        record[rng.randrange(lo, hi)] ^= 1 << rng.randrange(8)
    client.put(name, memoryview(record))


@contextlib.contextmanager
def _obj_faulty(tmp, err, direction, host, namespace):
    from .s3 import Fault, FaultyS3Proxy, shared_server
    status, code = OBJ_FAULT_STATUS[err]
    with FaultyS3Proxy(shared_server().port) as proxy:
        config = _obj_config(tmp, 1 << 30)
        config["store_config"]["endpoint_override"] = proxy.endpoint
        tier = plugins.tiers()["obj"].factory(config, host, namespace)
        proxy.set_fault(Fault("status", ("PUT",) if direction == "store" else ("GET",),
                              status=status, code=code))
        try:
            yield tier
        finally:
            tier.close()


def _obj_stored_objects(config: Config) -> tuple[list[str], list[str]]:
    from kvhal.tiers.obj.client import S3Client
    from kvhal.tiers.obj.config import parse_config
    cfg = parse_config(config)
    names = [n for n, _, _ in S3Client(cfg.store, 10.0, 2).list(cfg.prefix + "/")]
    return [n for n in names if n.endswith(".kv")], [n for n in names if not n.endswith(".kv")]


register_harness(TierHarness(
    "obj", config=_obj_config, persistent=True, shared_by_processes=True,
    damage=_obj_damage, damage_kinds=DAMAGE_KINDS, faulty=_obj_faulty,
    stored_objects=_obj_stored_objects, extra=("s3", "kvhal.tiers.obj"),
    # a PUT is atomic on the server, so a kill can only lose a chunk, never tear one; 20 points
    # cover kills before, during and after requests (100 took ~5 min on 2 loaded cores)
    kill_points=20))


# -- p2p ------------------------------------------------------------------------------------
register_harness(TierHarness(
    "p2p", config=p2p.config, persistent=True, shared_by_processes=True,
    services=p2p.keeper, settle=p2p.settle, ready=p2p.ready, damage=p2p.damage,
    damage_kinds=("bitflip-payload", "truncate", "delete"), extra=("p2p", "kvhal.tiers.p2p"),
    # each kill point starts a writer process and the keeper pulls each chunk it reports
    kill_points=12,
    why_not="p2p chunks live in the memory of the instances serving them (no files, no "
            "errno-level I/O to inject)"))


# -- mooncake -------------------------------------------------------------------------------
register_harness(TierHarness(
    "mooncake", config=mooncake.config, persistent=True, shared_by_processes=True,
    damage=mooncake.damage, damage_kinds=DAMAGE_KINDS, own_capacity=False, kill_points=12,
    why_not="a Mooncake pool's capacity and eviction are its master's (watermark, leases), "
            "not max_bytes LRU, and its client has no errno-level I/O to inject (real master "
            "kills, a full pool and eviction: tests/tiers/test_mooncake_tier.py)"))
