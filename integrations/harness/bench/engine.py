"""`kvhal bench engine`: manager bookkeeping per chunk, and the host-tier round trip vs memcpy.

Bookkeeping: a manager over `--capacity` slots (LRU, no secondary tier, KV events on) times,
per chunk, a lookup of a `--chunks`-chunk prefix that all hits (with a request's pins), a
prepare + complete store of `--chunks` new chunks (evicting as many old ones once full), and a
prepare + complete load of `--chunks` chunks. Target: ≤ 2 µs per chunk for each.

Busy fs (`--busy-fs`): the same bookkeeping again while an fs tier (its own host buffer of
16 × 2 MiB chunks, a temporary folder) stores and reads back batches of chunks as fast as its
threads can, driven from another thread: the scheduler's per-chunk cost under GIL contention
from the tier's I/O threads. Busy and idle passes alternate (the tier is paused between
batches for the idle ones), so both figures see the same machine load. Target: busy ≤ 2 ×
idle for each operation. `fs_gbps` is the tier's throughput over the whole
measurement, idle passes included.

Round trip: `--rt-chunks` chunks of `--chunk-mib` MiB (each `--blocks-per-chunk` device blocks,
`BlockPlanner` layout) are stored device → host through manager + worker + cpu backend, then
loaded back host → device into other blocks. The device blocks are a seeded random permutation
(as a serving engine's block table after churn), so a chunk's blocks are almost never
neighbours and the engine can merge almost none of them into larger copies. The baseline
copies the same blocks the same two ways, between the same device addresses and a host buffer
laid out like the slots, with one `np.copyto` per block on one thread, in the same run.
Ratio = memcpy time / engine time (target ≥ 0.9). Each figure is the best of `--repeats`
(default 20) timed passes after one warm-up pass; engine and memcpy passes alternate, so both
see the same machine load. Afterwards the load's blocks are zeroed and one more engine pass
must restore every block exactly.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

from kvhal.argtypes import positive_int
from kvhal.engine import BlockPlanner, Manager, Worker
from kvhal.hal import address_array
from kvhal.host import HostRegion, LRUPolicy, SlotTable, host_geometry
from kvhal.keys import ChunkKey, NAMESPACE_BYTES
from kvhal.plugins import select_backend
from kvhal.report import print_json, print_table, progress

TARGET_US_PER_CHUNK = 2.0
TARGET_RATIO = 0.9
TARGET_BUSY_RATIO = 2.0


@dataclass(frozen=True, slots=True)
class BookkeepingResult:
    """Microseconds per chunk of each manager operation pair: best and median of the
    repeats."""

    chunks: int
    lookup_us: float
    store_us: float
    load_us: float
    lookup_median_us: float
    store_median_us: float
    load_median_us: float


@dataclass(frozen=True, slots=True)
class RoundTripResult:
    """Host-tier store + load round trip vs memcpy, in GB/s (1e9 bytes/s, both directions)."""

    chunk_bytes: int
    chunks: int
    engine_gbps: float
    memcpy_gbps: float

    @property
    def ratio(self) -> float:
        """engine / memcpy throughput."""
        return self.engine_gbps / self.memcpy_gbps


def _keys(n: int, tag: int) -> list[ChunkKey]:
    ns = bytes(NAMESPACE_BYTES)
    return [ChunkKey(ns, 0, (tag << 40 | i).to_bytes(16, "big")) for i in range(n)]


def _best_alternating(a, b, repeats: int) -> tuple[float, float]:
    """Best times of `a` and `b` run in turn (so both see the same machine load)."""
    a(), b()
    best_a = best_b = float("inf")
    for _ in range(repeats):
        best_a, best_b = min(best_a, a()), min(best_b, b())
    return best_a, best_b


def _operations(chunks: int, capacity: int):
    """The three timed operations (name → function returning seconds) over one manager."""
    manager = Manager(SlotTable(capacity, LRUPolicy(capacity)), slot_bytes=1 << 21,
                      chunk_nbytes=1 << 21)
    resident = _keys(chunks, 0)
    plan = manager.prepare_store(resident)
    manager.complete_store(plan.job_id)
    tags = iter(range(1, 1 << 30))

    def lookup() -> float:
        t0 = time.perf_counter()
        manager.lookup(resident, pin_owner=1)
        dt = time.perf_counter() - t0
        manager.release(1)
        return dt

    def store() -> float:
        keys = _keys(chunks, next(tags))     # fresh keys; evicts old ones once full
        t0 = time.perf_counter()
        p = manager.prepare_store(keys)
        manager.complete_store(p.job_id)
        return time.perf_counter() - t0

    def load() -> float:
        t0 = time.perf_counter()
        p = manager.prepare_load(resident)
        manager.complete_load(p.job_id)
        return time.perf_counter() - t0

    return {"lookup": lookup, "load": load, "store": store}  # store last: it evicts


def _result(chunks: int, seconds: dict[str, list[float]]) -> BookkeepingResult:
    us = {op: [min(ts) / chunks * 1e6, float(np.median(ts)) / chunks * 1e6]
          for op, ts in seconds.items()}
    return BookkeepingResult(chunks, us["lookup"][0], us["store"][0], us["load"][0],
                             us["lookup"][1], us["store"][1], us["load"][1])


def bookkeeping(chunks: int = 1000, capacity: int = 4000, repeats: int = 20) -> BookkeepingResult:
    """Measure manager bookkeeping (see module docstring): best and median of `repeats`
    passes of each operation after one warm-up pass."""
    ops = _operations(chunks, capacity)
    seconds: dict[str, list[float]] = {op: [] for op in ops}
    for op, fn in ops.items():
        fn()
        seconds[op] = [fn() for _ in range(repeats)]
    return _result(chunks, seconds)


def bookkeeping_busy_idle(fs: "BusyFsTier", chunks: int = 1000, capacity: int = 4000,
                          repeats: int = 20) -> tuple[BookkeepingResult, BookkeepingResult]:
    """Bookkeeping with `fs` moving chunks and with `fs` paused, in alternating passes (each
    pass times every operation once), so both figures see the same machine load. Returns
    (busy, idle)."""
    ops = _operations(chunks, capacity)
    for fn in ops.values():
        fn()
    runs = {phase: {op: [] for op in ops} for phase in ("busy", "idle")}
    for _ in range(repeats):
        for phase in ("busy", "idle"):
            fs.resume() if phase == "busy" else fs.pause()
            for op, fn in ops.items():
                runs[phase][op].append(fn())
    fs.pause()
    return _result(chunks, runs["busy"]), _result(chunks, runs["idle"])


class BusyFsTier:
    """An fs tier kept storing and loading 2 MiB chunks at full speed on a background thread
    (context manager; entering returns once the tier has moved its first bytes); `pause()`
    and `resume()` stop and restart it between batches of `chunks` stores and loads.
    `bytes_moved()` counts the bytes it stored and loaded so far."""

    def __init__(self, root: str, chunks: int = 16, chunk_bytes: int = 2 << 20):
        from kvhal.tiers.fs import FsTier

        self._host = bytearray(chunks * chunk_bytes)
        self._tier = FsTier({"root_dir": root}, memoryview(self._host), bytes(NAMESPACE_BYTES))
        self._ids = iter(range(1, 1 << 62))
        self._chunks, self._chunk_bytes = chunks, chunk_bytes
        self._stop = threading.Event()
        self._go = threading.Event()
        self._go.set()
        self._parked = threading.Event()
        self._running = threading.Event()
        self._thread = threading.Thread(target=self._drive, name="bench-busy-fs", daemon=True)

    def _job(self, i: int, tag: int, kind):
        from kvhal.tier import TierJob

        return TierJob(next(self._ids), kind, _keys(1, tag << 8 | i)[0], i * self._chunk_bytes,
                       self._chunk_bytes)

    def _batch(self, tag: int, kind) -> None:
        from kvhal.tier import JobKind

        submit = self._tier.submit_store if kind is JobKind.STORE else self._tier.submit_load
        for i in range(self._chunks):
            submit(self._job(i, tag, kind))
        self._tier.drain()
        self._tier.get_finished_jobs()

    def _drive(self) -> None:
        from kvhal.tier import JobKind

        tag = 1 << 20
        while not self._stop.is_set():
            if not self._go.is_set():
                self._running.clear()
                self._parked.set()
                self._go.wait()
                continue
            self._parked.clear()
            self._running.set()
            tag += 1
            self._batch(tag, JobKind.STORE)
            self._batch(tag, JobKind.LOAD)

    def pause(self) -> None:
        """Stop after the current batch; returns once no job is in flight."""
        self._go.clear()
        self._parked.wait()

    def resume(self) -> None:
        """Start moving chunks again; returns once a batch has begun."""
        self._go.set()
        self._running.wait()

    def bytes_moved(self) -> int:
        """Bytes the tier stored plus bytes it loaded so far."""
        stats = self._tier.stats()
        return int(stats.get("bytes_stored", 0)) + int(stats.get("bytes_loaded", 0))

    def __enter__(self) -> "BusyFsTier":
        self._thread.start()
        deadline = time.monotonic() + 60
        while self.bytes_moved() == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._go.set()
        self._thread.join()
        self._running.set()
        self._tier.close()


def round_trip(backend_name: str | None = None, chunk_bytes: int = 2 << 20, chunks: int = 64,
               blocks_per_chunk: int = 16, repeats: int = 20) -> RoundTripResult:
    """Measure the host-tier round trip vs memcpy (see module docstring)."""
    backend = select_backend(backend_name)
    block_bytes = chunk_bytes // blocks_per_chunk
    num_blocks = 2 * chunks * blocks_per_chunk
    geo = host_geometry(chunk_bytes, chunks * chunk_bytes)
    region = HostRegion.allocate(backend, geo)
    dev = backend.alloc_device(num_blocks * block_bytes)
    scratch = backend.alloc_pinned(chunks * geo.slot_bytes)
    worker = Worker(backend, BlockPlanner(dev.ptr, block_bytes, num_blocks), host_ptr=region.ptr,
                    slot_bytes=geo.slot_bytes)
    manager = Manager(SlotTable(geo.capacity, LRUPolicy(geo.capacity)),
                      slot_bytes=geo.slot_bytes, chunk_nbytes=chunk_bytes)
    try:
        rng = np.random.default_rng(0)
        blocks = address_array(dev.ptr, dev.nbytes).reshape(num_blocks, block_bytes)
        blocks[:] = rng.integers(0, 256, block_bytes, dtype=np.uint8)
        blocks[:, :8] = np.arange(num_blocks, dtype="<u8").view(np.uint8).reshape(-1, 8)
        slots = address_array(scratch.ptr, scratch.nbytes).reshape(chunks, geo.slot_bytes)
        host = [slots[c, j * block_bytes:(j + 1) * block_bytes]
                for c in range(chunks) for j in range(blocks_per_chunk)]
        keys = _keys(chunks, 0)
        src_ids, dst_ids = rng.permutation(num_blocks).reshape(2, chunks, blocks_per_chunk)
        src_list, dst_list = src_ids.ravel().tolist(), dst_ids.ravel().tolist()

        def engine() -> float:
            manager.clear()
            t0 = time.perf_counter()
            plan = manager.prepare_store(keys)
            worker.submit_store(plan.job_id, src_ids[plan.indices], plan.slots)
            worker.wait(plan.job_id)
            for r in worker.get_finished():
                manager.complete_store(r.job_id, r.num_ok)
            plan = manager.prepare_load(keys)
            worker.submit_load(plan.job_id, dst_ids, plan.slots)
            worker.wait(plan.job_id)
            for r in worker.get_finished():
                manager.complete_load(r.job_id, r.num_ok)
            return time.perf_counter() - t0

        def memcpy() -> float:
            t0 = time.perf_counter()
            for h, b in zip(host, src_list):
                np.copyto(h, blocks[b])
            for h, b in zip(host, dst_list):
                np.copyto(blocks[b], h)
            return time.perf_counter() - t0

        moved = 2 * chunks * chunk_bytes
        memcpy_s, engine_s = _best_alternating(memcpy, engine, repeats)
        blocks[dst_list] = 0
        engine()
        assert np.array_equal(blocks[dst_list], blocks[src_list])
    finally:
        worker.close()
        region.close()
        backend.free(dev)
        backend.free(scratch)
    return RoundTripResult(chunk_bytes, chunks, moved / engine_s / 1e9, moved / memcpy_s / 1e9)


def run(args: argparse.Namespace) -> int:
    """Run both measurements and print them (table or JSON)."""
    with progress(disable=args.json) as bar:
        task = bar.add_task("bench engine", total=2)
        book = bookkeeping(args.chunks, repeats=args.repeats * 4)
        bar.advance(task)
        rt = round_trip(args.backend, args.chunk_mib << 20, args.rt_chunks, args.blocks_per_chunk,
                        args.repeats)
        bar.advance(task)
        busy = None
        if args.busy_fs:
            with (tempfile.TemporaryDirectory(dir=args.tmp_dir) as tmp,
                  BusyFsTier(os.path.abspath(tmp)) as fs):   # fs refuses a relative root
                start, before = time.perf_counter(), fs.bytes_moved()
                busy, idle = bookkeeping_busy_idle(fs, args.chunks, repeats=args.repeats * 4)
                seconds = time.perf_counter() - start
                moved = fs.bytes_moved() - before
            busy = {"idle": asdict(idle), "busy": asdict(busy),
                    "ratio": {op: getattr(busy, f"{op}_us") / getattr(idle, f"{op}_us")
                              for op in ("lookup", "store", "load")},
                    "median_ratio": {op: getattr(busy, f"{op}_median_us")
                                     / getattr(idle, f"{op}_median_us")
                                     for op in ("lookup", "store", "load")},
                    "fs_bytes_moved": moved, "seconds": seconds,
                    "fs_gbps": moved / seconds / 1e9}
    if args.json:
        print_json({"bookkeeping": asdict(book), "round_trip": asdict(rt) | {"ratio": rt.ratio},
                    **({"busy_fs": busy} if busy else {}),
                    "targets": {"us_per_chunk": TARGET_US_PER_CHUNK, "ratio": TARGET_RATIO,
                                "busy_ratio": TARGET_BUSY_RATIO}})
        return 0
    print_table(f"kvhal bench engine — manager bookkeeping, µs per chunk ({book.chunks}-chunk "
                f"prefix; target ≤ {TARGET_US_PER_CHUNK})", ["operation", "best", "median"],
                [[name, round(getattr(book, f"{op}_us"), 3),
                  round(getattr(book, f"{op}_median_us"), 3)]
                 for name, op in (("lookup (all hit, pinned)", "lookup"),
                                  ("prepare + complete store", "store"),
                                  ("prepare + complete load", "load"))])
    print_table(f"host-tier round trip, {rt.chunks} × {rt.chunk_bytes >> 20} MiB chunks (GB/s; "
                f"target ratio ≥ {TARGET_RATIO})", ["path", "GB/s", "ratio"],
                [["store + load (engine)", round(rt.engine_gbps, 2), round(rt.ratio, 3)],
                 ["memcpy (np.copyto)", round(rt.memcpy_gbps, 2), 1.0]])
    if busy:
        print_table(f"bookkeeping while an fs tier moves chunks at full speed "
                    f"({busy['fs_gbps']:.2f} GB/s during the {busy['seconds']:.1f} s; target "
                    f"busy ≤ {TARGET_BUSY_RATIO} × idle; best and median of the repeats)",
                    ["operation", "idle best", "busy best", "ratio", "idle median",
                     "busy median", "median ratio"],
                    [[op, round(busy["idle"][f"{op}_us"], 3), round(busy["busy"][f"{op}_us"], 3),
                      round(busy["ratio"][op], 2), round(busy["idle"][f"{op}_median_us"], 3),
                      round(busy["busy"][f"{op}_median_us"], 3),
                      round(busy["median_ratio"][op], 2)] for op in ("lookup", "store", "load")])
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `kvhal bench engine`."""
    p = sub.add_parser("engine", help="manager µs/chunk; host-tier round trip vs memcpy")
    p.add_argument("--backend", default=None, help="backend name (default: auto-select)")
    p.add_argument("--chunks", type=positive_int, default=1000,
                   help="prefix length for bookkeeping")
    p.add_argument("--rt-chunks", type=positive_int, default=64, help="chunks in the round trip")
    p.add_argument("--chunk-mib", type=positive_int, default=2, help="chunk size in MiB")
    p.add_argument("--blocks-per-chunk", type=positive_int, default=16,
                   help="device blocks per chunk")
    p.add_argument("--repeats", type=positive_int, default=20,
                   help="timed passes per round-trip figure (best; bookkeeping: 4x)")
    p.add_argument("--busy-fs", action="store_true",
                   help="also time bookkeeping while an fs tier reads and writes at full speed")
    p.add_argument("--tmp-dir", default=None, help="folder for --busy-fs (default $TMPDIR)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
