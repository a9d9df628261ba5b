"""`kvhal bench tier`: write and cold-read throughput of a secondary tier, side by side with a
raw loop of the same durability and, for `--tier fs` where vLLM is importable, vLLM's own
fs tier (`vllm_fs.py`), all on the same host bytes in the same run. For `--tier obj` the raw
loops are S3 clients against the same bucket (`tier_obj.py`); for `--tier mooncake` they are
Mooncake clients on the same pool, registered and plain, plus one chunk's latency
(`tier_mooncake.py`).

`--count` chunks of `--chunk-bytes` from one page-aligned host region are stored by each
contender (one job per chunk, all submitted, then drained), then loaded back into the zeroed
region after the page cache is emptied (`sync()`, then `posix_fadvise(DONTNEED)` on every
file: only clean pages can be dropped), and the loaded bytes are compared with the stored ones.
Every timed write starts after a `sync()`, so no contender pays for the writeback of another's
files; a write through the page cache is timed until the tier reports it stored (what a store
costs the engine), and its writeback is not (the kernel throttles a sustained stream to device
speed). Contenders:

- the kvhal tier, with `--config` merged into its defaults (checksums verified on every read);
- a raw loop on as many threads as the tier moves chunks with (fs: `io_threads`, reads on
  n_read_threads + n_write_threads, since its store threads load while no store is queued,
  and writes on n_write_threads; otherwise 1) with the tier's durability: one file per chunk
  written to a temp name (O_DIRECT when the tier uses it) and renamed; with durability
  "power-loss" also `fdatasync` before the rename and an fsync of the folder after it (a new
  name is durable only once its directory is synced: fsync(2), NOTES); reads open, `preadv`
  and close, no checks;
- vLLM's `FileSystemTierManager` with its default thread counts (fs only);
- fs: the disk itself (`tier_disk.py`): the same chunk I/O on as many threads, overwriting one
  preallocated file in place, so no per-file filesystem work: the ceiling for this chunk size;
- obj instead of the file loop: raw obstore and boto3 loops at the tier's `io_threads`
  (PUT = write, GET = cold read: an object store has no client-side cache).

Each pass (`--repeats`) uses fresh keys and files; within a pass the contenders take turns in
an order rotated every pass, and each figure is the median over the passes. Besides GB/s, each
timed write and read reports the CPU time this process spent meanwhile (user + system, all
threads: `getrusage(RUSAGE_SELF)`) per chunk, in microseconds: the contenders take turns, so
it is the cost of the one running (plus the kvhal tier's idle refresh thread, which is there
for every contender). Kernel threads' work (writeback, extent conversion, interrupts) is not
in it. CPU time depends far less than throughput on what the filesystem did in the minutes
before (ext4 without a journal slows its inode allocator for minutes after many deletes), so
it compares contenders' own work across runs.

`--full` (fs): the kvhal tier holds exactly `--count` chunks and is filled before the first
pass, so every timed store evicts (and recycles, `recycle_files`) one chunk of the previous
pass; the raw loop then deletes the previous pass's file of each chunk before writing it.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import mmap
import os
import resource
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np

from kvhal import plugins
from kvhal.argtypes import json_object, positive_int
from kvhal.keys import ChunkKey
from kvhal.report import print_json, print_table, progress
from kvhal.host.region import host_geometry
from kvhal.tier import HostSlots, JobKind, TierJob
from kvhal.tiers.chunk_format import record_nbytes
from kvhal.tiers.fs.remove import remove_tree

from . import links
from .copy import _size
from .tier_disk import DiskLoop
from .vllm_fs import VllmFsTier, vllm_available

ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)
#: Durability of a tier that does not report one in `stats()["durability"]`.
DEFAULT_DURABILITY = "power-loss"


@dataclass(frozen=True, slots=True)
class ContenderResult:
    """One contender's figures, one per pass: GB/s (1e9 bytes per second) of payload bytes, and
    this process's CPU time (user + system) in microseconds per chunk (module docstring)."""

    name: str
    threads: str
    durability: str
    o_direct: bool          # every read and write
    o_direct_writes: bool   # the writes (True with `o_direct`)
    write_gbps: tuple[float, ...]
    read_gbps: tuple[float, ...]
    write_cpu_us: tuple[float, ...]
    read_cpu_us: tuple[float, ...]
    #: kvhal's fs tier under `o_direct: "adaptive"` picks each large chunk's mode as it goes
    #: (`tiers/fs/large_io.py`): `o_direct*` then say only what it preferred at the start,
    #: which the raw loop follows; the stats in the JSON count what it did.
    adaptive: bool = False

    @property
    def write_median(self) -> float:
        """Median write throughput over the passes, GB/s."""
        return statistics.median(self.write_gbps)

    @property
    def read_median(self) -> float:
        """Median cold-read throughput over the passes, GB/s."""
        return statistics.median(self.read_gbps)

    def cpu_median(self, direction: str) -> float:
        """Median CPU time per chunk over the passes in `direction` ("write" or "read"), µs."""
        return statistics.median(getattr(self, f"{direction}_cpu_us"))


@dataclass(frozen=True, slots=True)
class TierBenchResult:
    """All contenders of one run; `contenders[0]` is the kvhal tier, `[1]` the raw loop and,
    where measured, `[2]` vLLM's fs tier (obj: `[1]` raw obstore, `[2]` raw boto3; mooncake:
    `[1]` raw put_from/get_into, `[2]` raw put/get, `[3]` raw +header); fs ends with the disk
    loop (`tier_disk.DiskLoop`)."""

    tier: str
    chunk_bytes: int
    count: int
    repeats: int
    contenders: tuple[ContenderResult, ...]
    vllm_note: str
    full: bool = False
    #: The kvhal tier's `stats()` after the last pass (evictions, files_recycled, ...).
    kvhal_stats: dict | None = None
    #: mooncake: median µs of one chunk stored / loaded alone, per contender
    #: (`tier_mooncake.latency_us`).
    latency_us: dict | None = None

    def ratio(self, baseline: int, direction: str) -> float | None:
        """Median of the kvhal tier / median of `contenders[baseline]` in `direction`
        ("write" or "read"); None if that contender was not measured."""
        if baseline >= len(self.contenders):
            return None
        kvhal, other = self.contenders[0], self.contenders[baseline]
        return getattr(kvhal, f"{direction}_median") / getattr(other, f"{direction}_median")

    def per_pass(self, baseline: int, direction: str) -> list[float]:
        """kvhal tier / `contenders[baseline]` throughput of each pass in `direction` (the two
        ran back to back in that pass): the figures a speed target is settled by, pooled."""
        kvhal, other = self.contenders[0], self.contenders[baseline]
        return [a / b for a, b in zip(getattr(kvhal, f"{direction}_gbps"),
                                      getattr(other, f"{direction}_gbps"))]

    def index(self, name: str) -> int:
        """Position of the contender called `name`, or `len(contenders)` if none is."""
        return next((i for i, c in enumerate(self.contenders) if c.name == name),
                    len(self.contenders))


def drop_page_cache(folder: str) -> None:
    """Empty the page cache of every file under `folder`: `sync()` first (dirty pages, such as
    those of buffered writes, cannot be dropped), then posix_fadvise(DONTNEED) on each file."""
    os.sync()
    for dirpath, _, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def block_hash(rep: int, i: int) -> bytes:
    """The 32-byte block hash of chunk `i` in pass `rep`, shared by kvhal's and vLLM's keys
    (sha256, as vLLM's default prefix-cache hash: names spread over folders as in service)."""
    return hashlib.sha256(f"kvhal-bench-tier {rep} {i}".encode()).digest()


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _TierContender:
    """The kvhal tier under test: one `TierJob` per chunk, chunk i at byte `i * stride`."""

    def __init__(self, name: str, tier, namespace: bytes, chunk: int, count: int,
                 stride: int) -> None:
        self.tier, self.namespace, self.chunk, self.count = tier, namespace, chunk, count
        self.stride = stride
        stats = tier.stats()
        config = getattr(tier, "config", None)
        io_threads = getattr(config, "io_threads", 1)
        self.threads = (getattr(config, "n_read_threads", io_threads),
                        getattr(config, "n_write_threads", io_threads))
        #: (threads that may run loads, threads that may run stores): the raw loops' thread
        #: counts (fs: its store threads load too, `FsTier.io_threads`).
        self.io_threads = getattr(tier, "io_threads", self.threads)
        self.durability = str(stats.get("durability", DEFAULT_DURABILITY))
        # chunk i lies at i * chunk of a page-aligned region: aligned iff chunk is; a tier
        # without `o_direct_for` (obj) moves no file
        direct_for = getattr(tier, "o_direct_for", None)
        aligned = chunk % ALIGN == 0 and direct_for is not None
        #: Writes with O_DIRECT (the tier's own rule for this chunk size).
        self.o_direct_writes = aligned and direct_for(JobKind.STORE, chunk)
        #: Every read and write of this run with O_DIRECT.
        self.o_direct = self.o_direct_writes and direct_for(JobKind.LOAD, chunk)
        adaptive_for = getattr(tier, "adaptive_for", None)
        #: The modes are chosen as the run goes (`o_direct: "adaptive"`).
        self.adaptive = aligned and adaptive_for is not None and adaptive_for(chunk)
        self.name = f"kvhal {name}"

    def keys(self, rep: int) -> list[ChunkKey]:
        """The keys of pass `rep`'s chunks, in slot order."""
        return [ChunkKey(self.namespace, 0, block_hash(rep, i)) for i in range(self.count)]

    def _run(self, kind: JobKind, rep: int) -> None:
        submit = self.tier.submit_store if kind is JobKind.STORE else self.tier.submit_load
        for i, key in enumerate(self.keys(rep)):
            submit(TierJob(i, kind, key, i * self.stride, self.chunk))
        self.tier.drain()
        failed = [r for r in self.tier.get_finished_jobs() if not r.ok]
        if failed:
            raise RuntimeError(f"{len(failed)} {kind.value} jobs failed, first: "
                               f"{failed[0].error}")

    def write(self, rep: int) -> None:
        self._run(JobKind.STORE, rep)

    def read(self, rep: int) -> None:
        self._run(JobKind.LOAD, rep)

    def close(self) -> None:
        self.tier.close()


class _RawLoop:
    """A raw file loop on a thread pool, with the durability of the tier it is compared to."""

    name = "raw loop"

    def __init__(self, root: str, host: memoryview, chunk: int, count: int,
                 threads: tuple[int, int], durability: str, o_direct: bool,
                 o_direct_writes: bool, full: bool = False) -> None:
        self.root, self.host, self.chunk, self.count = root, host, chunk, count
        self.threads, self.durability, self.o_direct = threads, durability, o_direct
        self.o_direct_writes = o_direct_writes
        self._sync = durability == "power-loss"
        #: `--full`: each write first deletes the previous pass's file of the same chunk, as a
        #: full tier that deletes and creates (pass -1 is written first, untimed).
        self._full = full

    def _folder(self, rep: int) -> str:
        return os.path.join(self.root, f"raw{rep}")

    def _write_one(self, folder: str, i: int, previous: str | None = None) -> None:
        if previous is not None:
            os.unlink(os.path.join(previous, str(i)))
        tmp, final = os.path.join(folder, f"{i}.tmp"), os.path.join(folder, str(i))
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        fd = os.open(tmp, flags | (_O_DIRECT if self.o_direct_writes else 0), 0o644)
        try:
            view, done = self.host[i * self.chunk:(i + 1) * self.chunk], 0
            while done < self.chunk:
                done += os.pwritev(fd, [view[done:]], done)
            if self._sync:
                os.fdatasync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, final)
        if self._sync:
            _fsync_dir(folder)

    def _read_one(self, folder: str, i: int) -> None:
        flags = os.O_RDONLY | os.O_CLOEXEC | (_O_DIRECT if self.o_direct else 0)
        fd = os.open(os.path.join(folder, str(i)), flags)
        try:
            if os.preadv(fd, [self.host[i * self.chunk:(i + 1) * self.chunk]], 0) != self.chunk:
                raise OSError(f"raw read of chunk {i} was short")
        finally:
            os.close(fd)

    def _map(self, fn, threads: int, rep: int) -> None:
        folder = self._folder(rep)
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda i: fn(folder, i), range(self.count)))

    def write(self, rep: int) -> None:
        os.makedirs(self._folder(rep))
        previous = self._folder(rep - 1) if self._full and rep >= 0 else None
        self._map(lambda folder, i: self._write_one(folder, i, previous), self.threads[1], rep)

    def read(self, rep: int) -> None:
        self._map(self._read_one, self.threads[0], rep)

    def close(self) -> None:
        pass


class _VllmContender:
    """vLLM's fs tier (`vllm_fs.VllmFsTier`) with its default thread counts."""

    name = VllmFsTier.name

    def __init__(self, root: str, host: memoryview, chunk: int, count: int) -> None:
        self.tier = VllmFsTier(os.path.join(root, "vllm"), host, chunk)
        self.threads, self.durability = self.tier.threads, self.tier.durability
        self.o_direct, self.count = self.tier.o_direct, count

    def _keys(self, rep: int) -> list[bytes]:
        return [VllmFsTier.key(block_hash(rep, i)) for i in range(self.count)]

    def write(self, rep: int) -> None:
        self.tier.store(self._keys(rep))

    def read(self, rep: int) -> None:
        self.tier.load(self._keys(rep))

    def close(self) -> None:
        self.tier.close()


def _timed(fn, *args) -> tuple[float, float]:
    """Run `fn(*args)`: (wall seconds, CPU seconds of this process, user + system)."""
    before = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    fn(*args)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_SELF)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def measure(tier_name: str, config: dict, root: str, chunk: int, count: int,
            repeats: int, bar=None, with_vllm: bool = True, full: bool = False
            ) -> TierBenchResult:
    """Run the benchmark (module docstring) with files under `root`.

    Args:
        with_vllm: Add vLLM's fs tier where `tier_name` is "fs" and vLLM is importable.
        full: fs only: the kvhal tier gets `max_bytes` of exactly `count` chunk files and is
            filled (untimed) before the first pass, so that every timed store evicts one
            chunk of the previous pass; the raw loop deletes that pass's file before each
            write; vLLM's tier, which has no capacity bound, is left out.

    Raises:
        RuntimeError: a job failed or a contender loaded other bytes than were stored.
        ValueError: `full` with a tier other than fs.
    """
    if full and tier_name != "fs":
        raise ValueError(f"--full: only for --tier fs (got {tier_name!r})")
    if full:
        config = config | {"max_bytes": count * record_nbytes(chunk)}
        with_vllm = False
    spec = plugins.tiers()[tier_name]
    # chunks lie in slots cut as the engine cuts them (with the tail the tier asks for)
    stride = host_geometry(chunk, 1 << 62, spec.host_tail_bytes).slot_bytes if (
        spec.host_tail_bytes) else chunk
    region = mmap.mmap(-1, stride * count)
    host = memoryview(region)
    array = np.frombuffer(host, dtype=np.uint8)
    payloads = array.reshape(count, stride)[:, :chunk]
    payloads[:] = np.random.default_rng(0).integers(0, 256, (count, chunk), dtype=np.uint8)
    reference = payloads.copy()
    namespace = b"kvhal-bench-tier"
    tier = spec.factory(config | {"type": tier_name}, host, namespace)
    if spec.host_tail_bytes:
        tier.attach_host(HostSlots(chunk, stride))
    contenders = [_TierContender(tier_name, tier, namespace, chunk, count, stride)]
    kv = contenders[0]
    if tier_name == "obj":
        from .tier_obj import raw_contenders
        contenders += raw_contenders(config | {"type": "obj"}, host, chunk, count)
    elif tier_name == "mooncake":
        from .tier_mooncake import raw_contenders as mooncake_contenders
        contenders += mooncake_contenders(config | {"type": "mooncake"}, host, chunk, stride,
                                          count,
                                          kv.io_threads)
    else:
        contenders.append(_RawLoop(root, host, chunk, count, kv.io_threads, kv.durability,
                                   kv.o_direct, kv.o_direct_writes, full))
    note = "--full: vllm's fs tier has no capacity bound: skipped" if full else _vllm_note(
        tier_name, with_vllm)
    try:
        if full:                                  # fill the kvhal tier and the raw loop
            for c in contenders:
                c.write(-1)
        if note is None:
            contenders.append(_VllmContender(root, host, chunk, count))
            note = "vllm fs tier measured"
        if tier_name == "fs":
            contenders.append(DiskLoop(root, host, chunk, count, kv.io_threads))
        times = {c.name: ([], []) for c in contenders}
        task = bar.add_task(f"bench tier [{tier_name}]", total=repeats) if bar else None
        for rep in range(repeats):
            order = contenders[rep % len(contenders):] + contenders[:rep % len(contenders)]
            for c in order:
                os.sync()
                times[c.name][0].append(_timed(c.write, rep))
            drop_page_cache(root)
            for c in order:
                array[:] = 0
                times[c.name][1].append(_timed(c.read, rep))
                if not np.array_equal(payloads, reference):
                    raise RuntimeError(f"{c.name}: loaded bytes differ from the stored bytes")
            if tier_name == "mooncake":            # untimed: the pool's memory is reused
                from .tier_mooncake import forget_pass
                forget_pass(contenders, rep)
            if bar:
                bar.advance(task)
        kvhal_stats = dict(tier.stats())
        latency = None
        if tier_name == "mooncake":
            from .tier_mooncake import latency_us
            latency = latency_us(tier, namespace, contenders[1:3], chunk, stride)
    finally:
        for c in contenders:
            c.close()
    total = chunk * count
    results = tuple(
        ContenderResult(c.name, f"{c.threads[0]}+{c.threads[1]}", c.durability, c.o_direct,
                        bool(getattr(c, "o_direct_writes", c.o_direct)),
                        tuple(total / wall / 1e9 for wall, _ in times[c.name][0]),
                        tuple(total / wall / 1e9 for wall, _ in times[c.name][1]),
                        tuple(cpu / count * 1e6 for _, cpu in times[c.name][0]),
                        tuple(cpu / count * 1e6 for _, cpu in times[c.name][1]),
                        bool(getattr(c, "adaptive", False)))
        for c in contenders)
    return TierBenchResult(tier_name, chunk, count, repeats, results, note, full, kvhal_stats,
                           latency)


def _vllm_note(tier_name: str, with_vllm: bool) -> str | None:
    """Why vLLM's fs tier is not measured, or None if it is."""
    if tier_name != "fs":
        return "vllm has no counterpart of this tier: skipped"
    if not with_vllm:
        return "--no-vllm: skipped"
    if not vllm_available():
        return "vllm not installed: skipped"
    return None


def to_json(result: TierBenchResult) -> dict:
    """The `--json` payload: every pass of every contender, medians and kvhal's ratios."""
    out = {"tier": result.tier, "chunk_bytes": result.chunk_bytes, "count": result.count,
           "repeats": result.repeats, "full": result.full, "vllm": result.vllm_note,
           "kvhal_stats": result.kvhal_stats, "latency_us": result.latency_us,
           "contenders": []}
    for c in result.contenders:
        out["contenders"].append(asdict(c) | {"write_median_gbps": c.write_median,
                                              "read_median_gbps": c.read_median,
                                              "write_median_cpu_us": c.cpu_median("write"),
                                              "read_median_cpu_us": c.cpu_median("read")})
    for direction in ("write", "read"):
        out[f"{direction}_vs_raw"] = result.ratio(1, direction)
        out[f"{direction}_vs_raw_per_pass"] = result.per_pass(1, direction)
        if result.tier == "mooncake":
            raw, plain = result.contenders[1], result.contenders[2]
            out[f"{direction}_vs_plain"] = result.ratio(2, direction)
            out[f"{direction}_vs_header"] = result.ratio(3, direction)
            out[f"registered_vs_plain_{direction}"] = (getattr(raw, f"{direction}_median")
                                                       / getattr(plain, f"{direction}_median"))
        elif result.tier != "obj":
            out[f"{direction}_vs_vllm"] = result.ratio(result.index(VllmFsTier.name), direction)
            out[f"{direction}_vs_disk"] = result.ratio(result.index(DiskLoop.name), direction)
        else:
            out[f"{direction}_vs_boto3"] = result.ratio(2, direction)
    return out


def run(args: argparse.Namespace) -> int:
    """Run `kvhal bench tier` and print the table (or JSON)."""
    if args.link:
        return _run_on_links(args)
    registered = plugins.tiers()
    if args.tier not in registered:
        raise ValueError(f"--tier: {args.tier!r} is not a registered tier type; registered: "
                         f"{', '.join(registered)}")
    config = json_object(args.config, "--config") if args.config else {}
    if args.root_dir is not None and os.path.isdir(args.root_dir) and os.listdir(args.root_dir):
        raise ValueError(f"--root-dir: {args.root_dir!r} is not empty; every contender writes "
                         "fresh files there: name a new or empty folder")
    # absolute: the fs tier refuses a relative root_dir
    root = os.path.abspath(args.root_dir or tempfile.mkdtemp(prefix="kvhal-bench-tier-"))
    os.makedirs(root, exist_ok=True)
    if args.tier == "fs":
        config.setdefault("root_dir", os.path.join(root, "tier"))
    try:
        with progress(disable=args.json) as bar, _store(args, config) as config:
            result = measure(args.tier, config, root, args.chunk_bytes, args.count,
                             args.repeats, bar, with_vllm=not args.no_vllm, full=args.full)
    finally:
        if args.root_dir is None:
            remove_tree(root)
    if args.json:
        print_json(to_json(result))
        return 0
    kvhal = result.contenders[0]
    rows = []
    for i, c in enumerate(result.contenders):
        w = "" if i == 0 else f"{kvhal.write_median / c.write_median:.2f}"
        r = "" if i == 0 else f"{kvhal.read_median / c.read_median:.2f}"
        direct = ("adaptive" if c.adaptive else "on" if c.o_direct
                  else "writes" if c.o_direct_writes else "off")
        rows.append([c.name, c.threads, c.durability, direct,
                     round(c.write_median, 3), w, round(c.cpu_median("write")),
                     round(c.read_median, 3), r, round(c.cpu_median("read"))])
    full = " (full: every store evicts)" if result.full else ""
    print_table(f"kvhal bench tier — {result.tier}{full}, {result.count} × "
                f"{result.chunk_bytes} B chunks, median of {result.repeats} alternating passes "
                f"(GB/s; CPU µs: this process's CPU time per chunk)",
                ["contender", "threads r+w", "durability", "O_DIRECT", "write", "kvhal ×",
                 "CPU µs", "cold read", "kvhal ×", "CPU µs"], rows)
    print(result.vllm_note)
    ratios = {d: result.per_pass(1, d) for d in ("write", "read")}
    print(f"kvhal / {result.contenders[1].name}, pass by pass: " + "; ".join(
        f"{d} geometric mean {statistics.geometric_mean(r):.2f} (passes "
        f"{min(r):.2f}-{max(r):.2f})" for d, r in ratios.items()))
    for name, us in (result.latency_us or {}).items():
        print(f"latency of one chunk alone, {name}: store {us['store']:.0f} µs, load "
              f"{us['load']:.0f} µs (median of {us['samples']:.0f})")
    adaptive = _adaptive_note(result.tier, result.kvhal_stats or {})
    if adaptive:
        print(adaptive)
    return 0


def _adaptive_note(tier: str, stats: dict) -> str | None:
    """What kvhal's `tier` (fs) chose under `o_direct: "adaptive"` (`tiers/fs/large_io.py`):
    how many large writes went each way (large reads are all O_DIRECT); None if it wrote no
    large chunk adaptively."""
    direct = stats.get("large_writes_o_direct", 0)
    written = direct + stats.get("large_writes_buffered", 0)
    return (f"kvhal {tier} adaptive: {direct} of {written} large writes with O_DIRECT"
            if written else None)


def _store(args: argparse.Namespace, config: dict):
    """obj: the bucket to measure against (`tier_obj.bucket_config`); mooncake: the pool
    (`tier_mooncake.pool_config`); other tiers: as is."""
    if args.tier == "obj":
        from .tier_obj import bucket_config
        return bucket_config(config)
    if args.tier == "mooncake":
        from .tier_mooncake import pool_config
        return pool_config(config, args.chunk_bytes, args.count, args.repeats)
    return contextlib.nullcontext(config)


#: `--link`: kvhal's loads at least this × the raw loop's count as keeping up with the link.
LINK_TARGET_RATIO = 0.9


def _run_on_links(args: argparse.Namespace) -> int:
    """`--link`: the bench inside each emulated link (`links.run_on_links`; obj: its local
    S3 server too), one row per link (write and cold read of kvhal and the raw loop, GB/s)
    and the crossover of cold reads at `LINK_TARGET_RATIO`; exit 1 if the slowest link is
    already below it."""
    if args.root_dir is not None:
        raise ValueError("--root-dir: not with --link (each link's run uses a folder of its "
                         "own, removed afterwards)")
    argv = ["bench", "tier", "--tier", args.tier, "--chunk-bytes", str(args.chunk_bytes),
            "--count", str(args.count), "--repeats", str(args.repeats),
            *(["--config", args.config] if args.config else []),
            *(["--no-vllm"] if args.no_vllm else []), *(["--full"] if args.full else [])]
    runs = links.run_on_links(argv, args.link)
    best = links.crossover([(s.rate_bps, r["read_vs_raw"]) for s, r in runs], LINK_TARGET_RATIO)
    if args.json:
        print_json({"links": [{"link": s.label, "rate_bps": s.rate_bps, "rtt_s": s.rtt_s, **r}
                              for s, r in runs],
                    "target_ratio": LINK_TARGET_RATIO, "crossover_bps": best})
        return 0 if best else 1
    rows = []
    for spec, r in runs:
        kvhal, raw = r["contenders"][0], r["contenders"][1]
        rows.append([spec.label, round(kvhal["write_median_gbps"], 3),
                     round(raw["write_median_gbps"], 3), round(r["write_vs_raw"], 3),
                     round(kvhal["read_median_gbps"], 3), round(raw["read_median_gbps"], 3),
                     round(r["read_vs_raw"], 3)])
    raw_name = runs[0][1]["contenders"][1]["name"] if runs else "raw"
    print_table(f"kvhal bench tier — {args.tier} on emulated links, {args.count} × "
                f"{args.chunk_bytes} B chunks, every process in a network namespace whose "
                f"loopback runs at the link's rate (tc tbf), medians of {args.repeats} passes "
                f"(GB/s)", ["link", "kvhal write", f"{raw_name} write", "× raw",
                            "kvhal cold read", f"{raw_name} cold read", "× raw"], rows)
    print(f"crossover: kvhal's verified loads stay >= {LINK_TARGET_RATIO} x {raw_name} up to "
          f"{links.LinkSpec(best).label}" if best else
          f"crossover: kvhal's verified loads are below {LINK_TARGET_RATIO} x {raw_name} at "
          f"every link measured")
    return 0 if best else 1


def register(sub: argparse._SubParsersAction) -> None:
    """Add `kvhal bench tier`."""
    p = sub.add_parser("tier", help="tier write / cold-read throughput vs a raw loop (files, "
                                    "or S3 requests for obj) and vLLM's fs tier")
    p.add_argument("--tier", default="fs", help="registered tier type (default: fs)")
    p.add_argument("--chunk-bytes", type=_size, default=2 << 20, help="e.g. 2MiB (default)")
    p.add_argument("--count", type=positive_int, default=256, help="chunks per pass (default 256)")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="alternating passes; medians are reported (default 3)")
    p.add_argument("--root-dir", default=None,
                   help="a new or empty folder for the files, kept afterwards (default: a "
                        "temp folder, removed afterwards)")
    p.add_argument("--config", default=None,
                   help="JSON object merged into the tier's config, e.g. "
                        "'{\"n_write_threads\": 8}'; obj: a \"store_config\" names the bucket "
                        "(default: a local moto_server started for the run); mooncake: a "
                        "\"master_server_address\" names the pool (default: a local master "
                        "and keeper started for the run)")
    p.add_argument("--no-vllm", action="store_true", help="leave out vLLM's fs tier")
    p.add_argument("--full", action="store_true",
                   help="fs: measure a full tier (max_bytes of exactly --count chunks, filled "
                        "first): every store evicts; the raw loop deletes a file per write; "
                        "vLLM's tier (no capacity bound) is left out")
    links.add_link_option(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
