"""`kvhal bench tier`: write and cold-read throughput of a secondary tier vs a raw loop.

fs (and any tier but obj): a raw file loop, below. obj: `measure_obj`, against a local
`moto_server` started for the run unless `--config` names a bucket.


`--count` chunks of `--chunk-bytes` from one page-aligned host region are stored through the
tier (all jobs submitted, then drained), then loaded back after the page cache is emptied with
`posix_fadvise(DONTNEED)` on every file. The baseline in the same run is a single-threaded
loop over the same bytes with the same durability: one file per chunk, opened with O_DIRECT
when the tier uses it, `fdatasync` before close, then an fsync of the folder (a new file's
name is durable only once its directory is synced: fsync(2), NOTES); reads after the same
DONTNEED. Each figure is
the best of `--repeats` passes (fresh keys and files per pass); raw and tier passes alternate.
"""
from __future__ import annotations

import argparse
import importlib.util
import mmap
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass

import numpy as np

from kvhal import plugins
from kvhal.argtypes import json_object, positive_int
from kvhal.keys import ChunkKey
from kvhal.report import print_json, print_table, progress
from kvhal.tiers.base import JobKind, TierJob

from .copy import _size

ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)


@dataclass(frozen=True, slots=True)
class TierBenchResult:
    """Throughputs in GB/s (1e9 bytes per second) of payload bytes."""

    tier: str
    chunk_bytes: int
    count: int
    o_direct: bool
    tier_write_gbps: float
    raw_write_gbps: float
    tier_read_gbps: float
    raw_read_gbps: float

    @property
    def write_ratio(self) -> float:
        """Tier write throughput / raw loop write throughput."""
        return self.tier_write_gbps / self.raw_write_gbps

    @property
    def read_ratio(self) -> float:
        """Tier cold-read throughput / raw loop cold-read throughput."""
        return self.tier_read_gbps / self.raw_read_gbps


def drop_page_cache(folder: str) -> None:
    """posix_fadvise(DONTNEED) every file under `folder` (clean pages leave the page cache)."""
    for dirpath, _, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _raw_write(folder: str, host: memoryview, chunk: int, count: int, direct: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | (_O_DIRECT if direct else 0)
    for i in range(count):
        fd = os.open(os.path.join(folder, str(i)), flags, 0o644)
        try:
            view, done = host[i * chunk:(i + 1) * chunk], 0
            while done < chunk:
                done += os.pwritev(fd, [view[done:]], done)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _raw_read(folder: str, host: memoryview, chunk: int, count: int, direct: bool) -> None:
    flags = os.O_RDONLY | os.O_CLOEXEC | (_O_DIRECT if direct else 0)
    for i in range(count):
        fd = os.open(os.path.join(folder, str(i)), flags)
        try:
            if os.preadv(fd, [host[i * chunk:(i + 1) * chunk]], 0) != chunk:
                raise OSError(f"raw read of chunk {i} was short")
        finally:
            os.close(fd)


def _tier_pass(tier, kind: JobKind, keys: list[ChunkKey], chunk: int) -> None:
    submit = tier.submit_store if kind is JobKind.STORE else tier.submit_load
    for i, key in enumerate(keys):
        submit(TierJob(i, kind, key, i * chunk, chunk))
    tier.drain()
    failed = [r for r in tier.get_finished_jobs() if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} {kind.value} jobs failed, first: {failed[0].error}")


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def measure(tier_name: str, config: dict, root: str, chunk: int, count: int,
            repeats: int, bar=None) -> TierBenchResult:
    """Run the benchmark (module docstring) with files under `root`; returns best figures.

    Raises:
        RuntimeError: a tier job failed or a loaded chunk differs from the stored bytes.
    """
    region = mmap.mmap(-1, chunk * count)
    host = memoryview(region)
    array = np.frombuffer(host, dtype=np.uint8)
    array[:] = np.random.default_rng(0).integers(0, 256, len(array), dtype=np.uint8)
    reference = array.copy()
    namespace = b"kvhal-bench-tier"
    tier = plugins.tiers()[tier_name].factory(config | {"type": tier_name}, host, namespace)
    direct = bool(tier.stats().get("o_direct", False)) and chunk % ALIGN == 0
    best = {"tw": float("inf"), "rw": float("inf"), "tr": float("inf"), "rr": float("inf")}
    task = bar.add_task(f"bench tier [{tier_name}]", total=repeats) if bar else None
    try:
        for rep in range(repeats):
            raw = os.path.join(root, f"raw{rep}")
            os.makedirs(raw)
            keys = [ChunkKey(namespace, rep, i.to_bytes(8, "big")) for i in range(count)]
            best["rw"] = min(best["rw"], _timed(_raw_write, raw, host, chunk, count, direct))
            best["tw"] = min(best["tw"], _timed(_tier_pass, tier, JobKind.STORE, keys, chunk))
            drop_page_cache(root)
            best["rr"] = min(best["rr"], _timed(_raw_read, raw, host, chunk, count, direct))
            drop_page_cache(root)
            array[:] = 0
            best["tr"] = min(best["tr"], _timed(_tier_pass, tier, JobKind.LOAD, keys, chunk))
            if not np.array_equal(array, reference):
                raise RuntimeError("loaded bytes differ from the stored bytes")
            shutil.rmtree(raw)
            if bar:
                bar.advance(task)
    finally:
        tier.close()
    total = chunk * count
    return TierBenchResult(tier_name, chunk, count, direct, total / best["tw"] / 1e9,
                           total / best["rw"] / 1e9, total / best["tr"] / 1e9,
                           total / best["rr"] / 1e9)


def _raw_obj_pass(pool, store, kind: JobKind, host: memoryview, chunk: int, count: int,
                  tag: str) -> None:
    """The raw client loop: one obstore PUT of each payload, or one GET of each object copied
    into its host slot, `pool`'s threads at a time (the tier's concurrency)."""
    import obstore

    def put(i: int) -> None:
        obstore.put(store, f"{tag}/{i}", host[i * chunk:(i + 1) * chunk], use_multipart=False)

    def get(i: int) -> None:
        host[i * chunk:(i + 1) * chunk] = memoryview(obstore.get(store, f"{tag}/{i}").bytes())

    list(pool.map(put if kind is JobKind.STORE else get, range(count)))


def measure_obj(config: dict, chunk: int, count: int, repeats: int,
                bar=None) -> TierBenchResult:
    """PUT and cold GET throughput of the obj tier (checksums on: every load verified) next
    to a raw obstore loop at the same concurrency (`io_threads`) against the same bucket, in
    the same run; raw and tier passes alternate, best of `repeats`. A GET is cold by nature
    (no client cache). Write figures are in the `*_write_gbps` fields, GETs in `*_read_gbps`.

    Raises:
        RuntimeError: a tier job failed or a loaded chunk differs from the stored bytes.
    """
    from concurrent.futures import ThreadPoolExecutor

    from kvhal.tiers.obj.client import S3Client
    from kvhal.tiers.obj.config import parse_config
    region = mmap.mmap(-1, chunk * count)
    host = memoryview(region)
    array = np.frombuffer(host, dtype=np.uint8)
    array[:] = np.random.default_rng(0).integers(0, 256, len(array), dtype=np.uint8)
    reference = array.copy()
    namespace = b"kvhal-bench-tier"
    cfg = parse_config(config)
    tier = plugins.tiers()["obj"].factory(config, host, namespace)
    raw = S3Client(cfg.store, cfg.timeout_s, 2 * cfg.io_threads).obstore
    pool = ThreadPoolExecutor(cfg.io_threads)
    best = {"tw": float("inf"), "rw": float("inf"), "tr": float("inf"), "rr": float("inf")}
    task = bar.add_task("bench tier [obj]", total=repeats) if bar else None
    try:
        for rep in range(repeats):
            keys = [ChunkKey(namespace, rep, i.to_bytes(8, "big")) for i in range(count)]
            tag = f"{cfg.prefix}/bench-raw/{os.getpid()}-{rep}".lstrip("/")
            best["rw"] = min(best["rw"], _timed(_raw_obj_pass, pool, raw, JobKind.STORE, host,
                                                chunk, count, tag))
            best["tw"] = min(best["tw"], _timed(_tier_pass, tier, JobKind.STORE, keys, chunk))
            array[:] = 0
            best["rr"] = min(best["rr"], _timed(_raw_obj_pass, pool, raw, JobKind.LOAD, host,
                                                chunk, count, tag))
            if not np.array_equal(array, reference):
                raise RuntimeError("raw GETs returned other bytes than stored")
            array[:] = 0
            best["tr"] = min(best["tr"], _timed(_tier_pass, tier, JobKind.LOAD, keys, chunk))
            if not np.array_equal(array, reference):
                raise RuntimeError("loaded bytes differ from the stored bytes")
            import obstore
            obstore.delete(raw, [f"{tag}/{i}" for i in range(count)]
                           + [tier.object_name(k) for k in keys])
            if bar:
                bar.advance(task)
    finally:
        pool.shutdown()
        tier.close()
    total = chunk * count
    return TierBenchResult("obj", chunk, count, False, total / best["tw"] / 1e9,
                           total / best["rw"] / 1e9, total / best["tr"] / 1e9,
                           total / best["rr"] / 1e9)


def _run_obj(args: argparse.Namespace, config: dict, bar) -> TierBenchResult:
    """`measure_obj` against `config`'s bucket, or a local moto_server started for the run."""
    config = {"type": "obj"} | config
    if "store_config" in config:
        return measure_obj(config, args.chunk_bytes, args.count, args.repeats, bar)
    from kvhal.tiers.obj.local_server import LocalS3Server
    with LocalS3Server() as server:
        server.create_bucket("kvhal-bench")
        config["store_config"] = {"bucket": "kvhal-bench", "endpoint_override": server.endpoint,
                                  "access_key": "bench", "secret_key": "bench"}
        return measure_obj(config, args.chunk_bytes, args.count, args.repeats, bar)


def vllm_note() -> str:
    """One line on the vLLM fs tier comparison (it runs only where vLLM is importable)."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm not installed: skipped"
    return "vllm installed, but its fs tier comparison is not implemented yet: skipped"


def run(args: argparse.Namespace) -> int:
    """Run `kvhal bench tier` and print the table (or JSON)."""
    registered = plugins.tiers()
    if args.tier not in registered:
        raise ValueError(f"--tier: {args.tier!r} is not a registered tier type; registered: "
                         f"{', '.join(registered)}")
    config = json_object(args.config, "--config") if args.config else {}
    if args.tier == "obj":
        with progress(disable=args.json) as bar:
            result = _run_obj(args, config, bar)
        return _report(args, result, "PUT", "cold GET",
                       f"obj (obstore), io_threads {config.get('io_threads', 4)}, "
                       "checksums verified, raw loop = obstore put/get at the same "
                       "concurrency")
    root = args.root_dir or tempfile.mkdtemp(prefix="kvhal-bench-tier-")
    os.makedirs(root, exist_ok=True)
    if args.tier == "fs":
        config.setdefault("root_dir", os.path.join(root, "tier"))
    try:
        with progress(disable=args.json) as bar:
            result = measure(args.tier, config, root, args.chunk_bytes, args.count,
                             args.repeats, bar)
    finally:
        if args.root_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    return _report(args, result, "write (durable)", "cold read",
                   f"{result.tier}, O_DIRECT {'on' if result.o_direct else 'off'}")


def _report(args: argparse.Namespace, result: TierBenchResult, write: str, read: str,
            what: str) -> int:
    note = vllm_note()
    if args.json:
        print_json(asdict(result) | {"write_ratio": result.write_ratio,
                                     "read_ratio": result.read_ratio, "vllm": note})
        return 0
    print_table(f"kvhal bench tier — {result.count} × {result.chunk_bytes} B chunks, {what} "
                "(GB/s)", ["direction", "tier", "raw loop", "tier ×"],
                [[write, round(result.tier_write_gbps, 3), round(result.raw_write_gbps, 3),
                  round(result.write_ratio, 2)],
                 [read, round(result.tier_read_gbps, 3), round(result.raw_read_gbps, 3),
                  round(result.read_ratio, 2)]])
    print(note)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `kvhal bench tier`."""
    p = sub.add_parser("tier", help="tier write / cold-read throughput vs a raw loop (files, "
                                    "or S3 requests for obj)")
    p.add_argument("--tier", default="fs", help="registered tier type (default: fs)")
    p.add_argument("--chunk-bytes", type=_size, default=2 << 20, help="e.g. 2MiB (default)")
    p.add_argument("--count", type=positive_int, default=256, help="chunks per pass (default 256)")
    p.add_argument("--repeats", type=positive_int, default=3, help="passes; best is reported")
    p.add_argument("--root-dir", default=None,
                   help="folder for the files (default: a temp folder, removed afterwards)")
    p.add_argument("--config", default=None,
                   help="JSON object merged into the tier's config, e.g. "
                        "'{\"n_write_threads\": 8}'")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
