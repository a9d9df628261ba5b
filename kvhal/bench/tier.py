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


def _bench_region(chunk: int, count: int) -> tuple[memoryview, np.ndarray, np.ndarray]:
    """A page-aligned host region of `count` chunks of seeded random bytes: (view, its uint8
    array, a copy to compare loads against)."""
    host = memoryview(mmap.mmap(-1, chunk * count))
    array = np.frombuffer(host, dtype=np.uint8)
    array[:] = np.random.default_rng(0).integers(0, 256, len(array), dtype=np.uint8)
    return host, array, array.copy()


def measure(tier_name: str, config: dict, root: str, chunk: int, count: int,
            repeats: int, bar=None) -> TierBenchResult:
    """Run the benchmark (module docstring) with files under `root`; returns best figures.

    Raises:
        RuntimeError: a tier job failed or a loaded chunk differs from the stored bytes.
    """
    host, array, reference = _bench_region(chunk, count)
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


def _obstore_loop(store):
    """The raw obstore loop: PUT each payload as is; GET each object into its host slot."""
    import obstore

    def put(name: str, view: memoryview) -> None:
        obstore.put(store, name, view, use_multipart=False)

    def get(name: str, view: memoryview) -> None:
        view[:] = memoryview(obstore.get(store, name).bytes())
    return put, get


def _boto3_loop(store_cfg, region: str, connections: int):
    """The raw boto3 loop (the other client measured): PUT each payload, GET each object with
    `readinto` straight into its host slot; botocore's own CRC32 checksums off (as kvhal
    verifies xxh3-128 itself)."""
    import boto3
    import botocore.config
    client = boto3.client(
        "s3", endpoint_url=store_cfg.endpoint, region_name=region,
        aws_access_key_id=store_cfg.access_key, aws_secret_access_key=store_cfg.secret_key,
        aws_session_token=store_cfg.session_token,
        config=botocore.config.Config(max_pool_connections=connections,
                                      request_checksum_calculation="when_required",
                                      response_checksum_validation="when_required"))

    def put(name: str, view: memoryview) -> None:
        client.put_object(Bucket=store_cfg.bucket, Key=name, Body=bytes(view))

    def get(name: str, view: memoryview) -> None:
        raw, done = client.get_object(Bucket=store_cfg.bucket, Key=name)["Body"], 0
        while done < len(view) and (n := raw._raw_stream.readinto(view[done:])):
            done += n
        raw.close()
    return put, get


def _raw_obj_pass(pool, op, kind: JobKind, host: memoryview, chunk: int, count: int,
                  tag: str) -> None:
    """One raw-loop pass: `op` = (put, get) of a client, `pool`'s threads at a time."""
    fn = op[0] if kind is JobKind.STORE else op[1]
    list(pool.map(lambda i: fn(f"{tag}/{i}", host[i * chunk:(i + 1) * chunk]), range(count)))


def measure_obj(config: dict, chunk: int, count: int, repeats: int,
                bar=None) -> tuple[TierBenchResult, dict[str, float]]:
    """PUT and cold GET throughput of the obj tier (checksums on: every load verified) next
    to raw client loops at the same concurrency (`io_threads`) against the same bucket, in
    the same run: obstore (the tier's client; the ratios) and boto3 (the client not chosen).
    Passes alternate, best of `repeats`. A GET is cold by nature (no client cache). PUT
    figures are in the `*_write_gbps` fields, GETs in `*_read_gbps`.

    Returns:
        The result, and {"boto3_write_gbps", "boto3_read_gbps"}.

    Raises:
        RuntimeError: a tier job failed or loaded bytes differ from the stored bytes.
    """
    from concurrent.futures import ThreadPoolExecutor

    from kvhal.tiers.obj.client import S3Client
    from kvhal.tiers.obj.config import parse_config
    host, array, reference = _bench_region(chunk, count)
    namespace = b"kvhal-bench-tier"
    cfg = parse_config(config)
    tier = plugins.tiers()["obj"].factory(config, host, namespace)
    raw = S3Client(cfg.store, cfg.timeout_s, 2 * cfg.io_threads)
    loops = {"r": _obstore_loop(raw.obstore),
             "b": _boto3_loop(cfg.store, raw.region, 2 * cfg.io_threads)}
    pool = ThreadPoolExecutor(cfg.io_threads)
    best = dict.fromkeys(("tw", "rw", "bw", "tr", "rr", "br"), float("inf"))
    task = bar.add_task("bench tier [obj]", total=repeats) if bar else None

    def check(what: str) -> None:
        if not np.array_equal(array, reference):
            raise RuntimeError(f"{what} returned other bytes than stored")
        array[:] = 0

    try:
        for rep in range(repeats):
            array[:] = reference
            keys = [ChunkKey(namespace, rep, i.to_bytes(8, "big")) for i in range(count)]
            tags = {c: f"{cfg.prefix}/bench-raw/{os.getpid()}-{rep}-{c}".lstrip("/")
                    for c in loops}
            for c, op in loops.items():
                best[c + "w"] = min(best[c + "w"], _timed(_raw_obj_pass, pool, op,
                                                          JobKind.STORE, host, chunk, count,
                                                          tags[c]))
            best["tw"] = min(best["tw"], _timed(_tier_pass, tier, JobKind.STORE, keys, chunk))
            array[:] = 0
            for c, op in loops.items():
                best[c + "r"] = min(best[c + "r"], _timed(_raw_obj_pass, pool, op,
                                                          JobKind.LOAD, host, chunk, count,
                                                          tags[c]))
                check(f"raw {c} GETs")
            best["tr"] = min(best["tr"], _timed(_tier_pass, tier, JobKind.LOAD, keys, chunk))
            check("tier loads")
            raw.delete([f"{t}/{i}" for t in tags.values() for i in range(count)]
                       + [tier.object_name(k) for k in keys])
            if bar:
                bar.advance(task)
    finally:
        pool.shutdown()
        tier.close()
    gbps = {k: chunk * count / v / 1e9 for k, v in best.items()}
    return (TierBenchResult("obj", chunk, count, False, gbps["tw"], gbps["rw"], gbps["tr"],
                            gbps["rr"]),
            {"boto3_write_gbps": gbps["bw"], "boto3_read_gbps": gbps["br"]})


def _run_obj(args: argparse.Namespace, config: dict, bar):
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
            result, boto3 = _run_obj(args, config, bar)
        return _report(args, result, "PUT", "cold GET",
                       f"obj, io_threads {config.get('io_threads', 4)}, checksums verified, "
                       "raw loop = obstore (the tier's client) at the same concurrency",
                       ("boto3 loop", [boto3["boto3_write_gbps"], boto3["boto3_read_gbps"]]),
                       boto3)
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
            what: str, extra: tuple[str, list[float]] | None = None,
            extra_json: dict | None = None) -> int:
    """Print the result table (or JSON); `extra` = (column, [write, read] GB/s) appended."""
    note = vllm_note()
    if args.json:
        print_json(asdict(result) | {"write_ratio": result.write_ratio,
                                     "read_ratio": result.read_ratio, "vllm": note}
                   | (extra_json or {}))
        return 0
    columns = ["direction", "tier", "raw loop", "tier ×"] + ([extra[0]] if extra else [])
    rows = [[write, round(result.tier_write_gbps, 3), round(result.raw_write_gbps, 3),
             round(result.write_ratio, 2)],
            [read, round(result.tier_read_gbps, 3), round(result.raw_read_gbps, 3),
             round(result.read_ratio, 2)]]
    for row, value in zip(rows, extra[1] if extra else []):
        row.append(round(value, 3))
    print_table(f"kvhal bench tier — {result.count} × {result.chunk_bytes} B chunks, {what} "
                "(GB/s)", columns, rows)
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
