"""`kvhal bench copy`: D2H, H2D and bidirectional throughput of a backend vs numpy memcpy.

For each block size, `count = min(1000, 1 GiB // block)` blocks are copied as one
`copy_batch_async` per direction (device block i ↔ host block perm[i], a seeded permutation, so
the blocks are scattered as they are in a KV cache); the baseline copies the same blocks between
two host buffers with one `np.copyto` per block in the same run. On the cuda backend the same
blocks, buffers and streams are also copied by one plain `cudaMemcpyAsync` per block, called
through cuda-python (`cuda.bindings.runtime`) and not through kvhal, as a GPU program without
kvhal would copy them; `d2h_vs_memcpy_async` and `h2d_vs_memcpy_async` are kvhal ÷ that. Each
figure is the best of `--repeats` timed passes, after one warm-up pass that faults every page in.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np

from kvhal.hal import DeviceBackend, Stream, host_array
from kvhal.plugins import select_backend
from kvhal.report import print_json, print_table, progress

BLOCK_SIZES = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 2 << 20, 16 << 20)
MAX_BLOCKS = 1000
MAX_BYTES_PER_DIRECTION = 1 << 30


@dataclass(frozen=True, slots=True)
class CopyResult:
    """Throughputs for one block size, in GB/s (1e9 bytes per second)."""

    block_bytes: int
    blocks: int
    d2h_gbps: float
    h2d_gbps: float
    bidir_gbps: float
    memcpy_gbps: float
    memcpy_async_d2h_gbps: float | None = None   # one cudaMemcpyAsync per block (cuda only)
    memcpy_async_h2d_gbps: float | None = None

    @property
    def d2h_ratio(self) -> float:
        """D2H throughput / numpy memcpy throughput."""
        return self.d2h_gbps / self.memcpy_gbps

    @property
    def h2d_ratio(self) -> float:
        """H2D throughput / numpy memcpy throughput."""
        return self.h2d_gbps / self.memcpy_gbps

    @property
    def d2h_vs_memcpy_async(self) -> float | None:
        """D2H throughput / plain cudaMemcpyAsync D2H throughput (None off cuda)."""
        return None if self.memcpy_async_d2h_gbps is None else \
            self.d2h_gbps / self.memcpy_async_d2h_gbps

    @property
    def h2d_vs_memcpy_async(self) -> float | None:
        """H2D throughput / plain cudaMemcpyAsync H2D throughput (None off cuda)."""
        return None if self.memcpy_async_h2d_gbps is None else \
            self.h2d_gbps / self.memcpy_async_h2d_gbps


#: A per-block copy loop: (dsts, srcs, sizes as uint64 arrays, stream) → None.
BatchCopy = Callable[[np.ndarray, np.ndarray, np.ndarray, Stream], None]


def memcpy_async_baseline(backend: Any) -> BatchCopy | None:
    """One plain `cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, stream)` per block through
    cuda-python's `cuda.bindings.runtime` (not kvhal's backend code), on the stream handle of
    a cuda `Stream`; None for any backend other than "cuda".

    The loop raises RuntimeError naming the runtime's error if a call fails."""
    if getattr(backend, "name", None) != "cuda":
        return None
    from cuda.bindings import runtime as rt

    kind = rt.cudaMemcpyKind.cudaMemcpyDefault
    success = rt.cudaError_t.cudaSuccess

    def copy(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: Stream) -> None:
        for dst, src, nbytes in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
            (err,) = rt.cudaMemcpyAsync(dst, src, nbytes, kind, stream.handle)
            if err != success:
                raise RuntimeError(f"cudaMemcpyAsync({nbytes} bytes) returned "
                                   f"{getattr(err, 'name', err)} ({int(err)})")

    return copy


def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: faults pages in, starts threads
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(backend: DeviceBackend, block_bytes: int, repeats: int = 3, seed: int = 0,
            baseline: BatchCopy | None = None) -> CopyResult:
    """Measure one block size (see module docstring); buffers are freed before returning.
    With `baseline` (`memcpy_async_baseline`), D2H and H2D are also timed through it on the
    same buffers and streams."""
    count = min(MAX_BLOCKS, MAX_BYTES_PER_DIRECTION // block_bytes)
    total = count * block_bytes
    dev = [backend.alloc_device(total) for _ in range(2)]
    host = [backend.alloc_pinned(total) for _ in range(2)]
    streams: list[Stream] = [backend.create_stream(), backend.create_stream()]
    try:
        perm = np.random.default_rng(seed).permutation(count).astype(np.uint64)
        offs = np.arange(count, dtype=np.uint64) * np.uint64(block_bytes)
        sizes = np.full(count, block_bytes, dtype=np.uint64)
        host_offs = perm * np.uint64(block_bytes)
        for i, h in enumerate(host):  # real data everywhere: untouched pages read as zeros
            host_array(h)[:] = np.random.default_rng(seed + i).integers(0, 255, 1, np.uint8)
            backend.copy_async(dev[i].ptr, h.ptr, total, streams[i])
            backend.stream_synchronize(streams[i])

        def d2h(i: int = 0, copy: BatchCopy = backend.copy_batch_async) -> None:
            copy(np.uint64(host[i].ptr) + host_offs, np.uint64(dev[i].ptr) + offs, sizes,
                 streams[i])

        def h2d(i: int = 1, copy: BatchCopy = backend.copy_batch_async) -> None:
            copy(np.uint64(dev[i].ptr) + offs, np.uint64(host[i].ptr) + host_offs, sizes,
                 streams[i])

        def run_d2h(copy: BatchCopy = backend.copy_batch_async) -> None:
            d2h(copy=copy)
            backend.stream_synchronize(streams[0])

        def run_h2d(copy: BatchCopy = backend.copy_batch_async) -> None:
            h2d(copy=copy)
            backend.stream_synchronize(streams[1])

        def run_bidir() -> None:
            d2h()
            h2d()
            backend.stream_synchronize(streams[0])
            backend.stream_synchronize(streams[1])

        src = host_array(host[0]).reshape(count, block_bytes)
        dst = host_array(host[1]).reshape(count, block_bytes)
        order = perm.astype(np.int64).tolist()

        def run_memcpy() -> None:
            for i, j in enumerate(order):
                np.copyto(dst[j], src[i])

        runs = [("memcpy", run_memcpy), ("d2h", run_d2h), ("h2d", run_h2d),
                ("bidir", run_bidir)]
        if baseline is not None:
            runs += [("async_d2h", lambda: run_d2h(baseline)),
                     ("async_h2d", lambda: run_h2d(baseline))]
        gbps = {name: total * (2 if name == "bidir" else 1) / _best_seconds(fn, repeats) / 1e9
                for name, fn in runs}
    finally:
        for s in streams:
            backend.destroy_stream(s)
        for a in dev + host:
            backend.free(a)
    return CopyResult(block_bytes, count, gbps["d2h"], gbps["h2d"], gbps["bidir"],
                      gbps["memcpy"], gbps.get("async_d2h"), gbps.get("async_h2d"))


def _human(nbytes: int) -> str:
    for shift, unit in ((20, "MiB"), (10, "KiB")):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def run(args: argparse.Namespace) -> int:
    """Run the benchmark over every block size and print the table (or JSON)."""
    backend = select_backend(args.backend)
    baseline = memcpy_async_baseline(backend)
    results = []
    with progress(disable=args.json) as bar:
        task = bar.add_task(f"bench copy [{backend.name}]", total=len(args.sizes))
        for size in args.sizes:
            results.append(measure(backend, size, repeats=args.repeats, baseline=baseline))
            bar.advance(task)
    if args.json:
        print_json({"backend": backend.name,
                    "results": [asdict(r) | {"d2h_ratio": r.d2h_ratio, "h2d_ratio": r.h2d_ratio,
                                             "d2h_vs_memcpy_async": r.d2h_vs_memcpy_async,
                                             "h2d_vs_memcpy_async": r.h2d_vs_memcpy_async}
                                for r in results]})
        return 0
    columns = ["block", "blocks", "D2H", "H2D", "bidir", "memcpy", "D2H ×", "H2D ×"]
    rows = [[_human(r.block_bytes), r.blocks, round(r.d2h_gbps, 2), round(r.h2d_gbps, 2),
             round(r.bidir_gbps, 2), round(r.memcpy_gbps, 2), round(r.d2h_ratio, 2),
             round(r.h2d_ratio, 2)] for r in results]
    title = f"kvhal bench copy — backend {backend.name} (GB/s; ratio vs numpy memcpy"
    if baseline is not None:
        columns += ["D2H cudaMemcpyAsync", "H2D cudaMemcpyAsync", "D2H ÷ async", "H2D ÷ async"]
        for row, r in zip(rows, results):
            row += [round(r.memcpy_async_d2h_gbps, 2), round(r.memcpy_async_h2d_gbps, 2),
                    round(r.d2h_vs_memcpy_async, 2), round(r.h2d_vs_memcpy_async, 2)]
        title += "; kvhal ÷ one cudaMemcpyAsync per block"
    print_table(title + ")", columns, rows)
    return 0


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    mult = units.get(t[-1:], 1)
    value = int(t[:-1] if t[-1:] in units else t)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"block size must be positive, got {text!r}")
    if value * mult > MAX_BYTES_PER_DIRECTION:
        raise argparse.ArgumentTypeError(f"block size must be at most 1 GiB (the per-direction "
                                         f"cap), got {text!r}")
    return value * mult


def _repeats(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"repeats must be at least 1, got {text!r}")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    """Add `kvhal bench copy`."""
    p = sub.add_parser("copy", help="D2H/H2D/bidirectional copy throughput vs numpy memcpy")
    p.add_argument("--backend", default=None, help="backend name (default: auto-select)")
    p.add_argument("--sizes", type=_size, nargs="+", default=list(BLOCK_SIZES),
                   help="block sizes, e.g. 4KiB 2MiB (default: 4K..16M)")
    p.add_argument("--repeats", type=_repeats, default=3, help="timed passes per figure (best)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
