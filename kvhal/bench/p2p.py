"""`kvhal bench p2p`: pull throughput of the p2p tier between two processes vs raw loops.

A serving process holds `--count` chunks of `--chunk-bytes` (seeded random bytes) three ways
at once: a standalone p2p tier, a raw TCP server (request: an 8-byte chunk index; reply: the
chunk's bytes by `sendall`) and a zmq ROUTER (reply: the chunk as one zero-copy frame). The
measuring process pulls every chunk with `--concurrency` threads, each with its own
connection: through a p2p tier (peers = the server; key, length and xxh3-128 checked), by the
raw TCP loop (`recv_into` the destination, nothing checked) and over zmq DEALER sockets
(`recv_into`). Each figure is the best of `--repeats` passes, the three kinds interleaved;
the p2p per-chunk latency (p50, p99) is the job wall time. Target: p2p >= 0.9 x raw TCP.
"""
from __future__ import annotations

import argparse
import multiprocessing
import queue
import socket
import statistics
import struct
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

from kvhal.argtypes import positive_int
from kvhal.keys import ChunkKey
from kvhal.report import print_json, print_table, progress

from .copy import _size

_NAMESPACE = b"kvhal-bench-p2p!"
_KEY = "kvhal-bench-p2p-shared-key"
_INDEX = struct.Struct("<Q")
TARGET_RATIO = 0.9


@dataclass(frozen=True, slots=True)
class P2PBenchResult:
    """Throughputs in GB/s (1e9 B/s) of payload bytes; latencies in milliseconds."""

    chunk_bytes: int
    count: int
    concurrency: int
    p2p_gbps: float
    raw_tcp_gbps: float
    zmq_gbps: float
    p2p_p50_ms: float
    p2p_p99_ms: float

    @property
    def ratio(self) -> float:
        """p2p / raw TCP throughput."""
        return self.p2p_gbps / self.raw_tcp_gbps


def _payload(count: int, chunk: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, count * chunk, dtype=np.uint8)


def _key(i: int) -> ChunkKey:
    return ChunkKey(_NAMESPACE, 0, i.to_bytes(8, "big"))


def _serve_raw(conn: socket.socket, data: memoryview, chunk: int) -> None:
    with conn:
        while True:
            header = conn.recv(_INDEX.size, socket.MSG_WAITALL)
            if len(header) < _INDEX.size:
                return
            (i,) = _INDEX.unpack(header)
            conn.sendall(data[i * chunk:(i + 1) * chunk])


def _serve_zmq(sock, data: memoryview, chunk: int) -> None:
    import zmq
    while True:
        try:
            ident, index = sock.recv_multipart()
        except zmq.ZMQError:
            return
        (i,) = _INDEX.unpack(index)
        sock.send_multipart([ident, data[i * chunk:(i + 1) * chunk]], copy=False)


def _server(pipe, count: int, chunk: int) -> None:
    """Serving process body: p2p tier, raw TCP and zmq servers over the same bytes."""
    import zmq

    from kvhal.tiers.base import JobKind, TierJob
    from kvhal.tiers.p2p import P2PTier
    array = _payload(count, chunk)
    data = memoryview(array)
    tier = P2PTier({"auth_key": _KEY, "max_bytes": count * chunk, "max_inflight": 64},
                   data, _NAMESPACE)
    for i in range(count):
        tier.submit_store(TierJob(i, JobKind.STORE, _key(i), i * chunk, chunk))
    tier.drain(600)
    listener = socket.create_server(("127.0.0.1", 0))
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    zmq_port = router.bind_to_random_port("tcp://127.0.0.1")
    threading.Thread(target=_serve_zmq, args=(router, data, chunk), daemon=True).start()

    def accept():
        while True:
            conn, _ = listener.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=_serve_raw, args=(conn, data, chunk), daemon=True).start()
    threading.Thread(target=accept, daemon=True).start()
    pipe.send((tier.identity, listener.getsockname()[1], zmq_port))
    pipe.recv()  # stop
    tier.close()


def _run_threads(concurrency: int, count: int, work) -> float:
    """Run `work(i)` for i < count on `concurrency` threads (each set up by `work.setup`);
    return the wall seconds."""
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in range(count):
        todo.put(i)
    states = [work.setup() for _ in range(concurrency)]
    errors: list[BaseException] = []

    def loop(state):
        try:
            while True:
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                work(state, i)
        except BaseException as exc:  # reported after the pass
            errors.append(exc)
    threads = [threading.Thread(target=loop, args=(s,)) for s in states]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    for s in states:
        work.teardown(s)
    if errors:
        raise RuntimeError(f"raw pull failed: {errors[0]!r}")
    return elapsed


class _RawTcp:
    def __init__(self, port: int, out: memoryview, chunk: int):
        self.port, self.out, self.chunk = port, out, chunk

    def setup(self):
        s = socket.create_connection(("127.0.0.1", self.port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return s

    def __call__(self, s, i):
        s.sendall(_INDEX.pack(i))
        view, done = self.out[i * self.chunk:(i + 1) * self.chunk], 0
        while done < self.chunk:
            n = s.recv_into(view[done:], self.chunk - done)
            if n == 0:
                raise ConnectionError("raw server closed")
            done += n

    def teardown(self, s):
        s.close()


class _Zmq:
    def __init__(self, port: int, out: memoryview, chunk: int):
        import zmq
        self.zmq, self.ctx = zmq, zmq.Context.instance()
        self.port, self.out, self.chunk = port, out, chunk

    def setup(self):
        s = self.ctx.socket(self.zmq.DEALER)
        s.connect(f"tcp://127.0.0.1:{self.port}")
        return s

    def __call__(self, s, i):
        s.send(_INDEX.pack(i))
        if s.recv_into(self.out[i * self.chunk:(i + 1) * self.chunk]) != self.chunk:
            raise ConnectionError("zmq frame of another size")

    def teardown(self, s):
        s.close(linger=0)


def _p2p_pass(tier, count: int, chunk: int) -> tuple[float, list[float]]:
    from kvhal.tiers.base import JobKind, TierJob
    t0 = time.perf_counter()
    for i in range(count):
        tier.submit_load(TierJob(i, JobKind.LOAD, _key(i), i * chunk, chunk))
    tier.drain(600)
    elapsed = time.perf_counter() - t0
    results = tier.get_finished_jobs()
    failed = [r for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} p2p pulls failed, first: {failed[0].error}")
    return elapsed, [r.seconds for r in results]


def measure(chunk: int, count: int, concurrency: int, repeats: int,
            bar=None) -> P2PBenchResult:
    """Run the benchmark (module docstring).

    Raises:
        RuntimeError: a pull failed or pulled bytes differ from the served ones.
    """
    from kvhal.tiers.p2p import P2PTier
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    server = ctx.Process(target=_server, args=(child, count, chunk), daemon=True)
    server.start()
    try:
        if not parent.poll(600):
            raise RuntimeError("the serving process did not start")
        identity, raw_port, zmq_port = parent.recv()
        out = np.zeros(count * chunk, dtype=np.uint8)
        view = memoryview(out)
        reference = _payload(count, chunk)
        tier = P2PTier({"auth_key": _KEY, "peers": [identity], "num_threads": concurrency,
                        "timeout_s": 60.0}, view, _NAMESPACE)
        raw, zmq_pull = _RawTcp(raw_port, view, chunk), _Zmq(zmq_port, view, chunk)
        best = {"p2p": float("inf"), "raw": float("inf"), "zmq": float("inf")}
        latencies: list[float] = []
        task = bar.add_task("bench p2p", total=repeats) if bar else None
        try:
            if not tier.wait_synced(60):
                raise RuntimeError("the p2p tier did not sync with the serving process")
            for _ in range(repeats):
                for name, run in (("raw", lambda: _run_threads(concurrency, count, raw)),
                                  ("zmq", lambda: _run_threads(concurrency, count, zmq_pull)),
                                  ("p2p", lambda: _p2p_pass(tier, count, chunk))):
                    out[:] = 0
                    result = run()
                    seconds, lat = result if name == "p2p" else (result, None)
                    if not np.array_equal(out, reference):
                        raise RuntimeError(f"{name} pass delivered wrong bytes")
                    if seconds < best[name]:
                        best[name] = seconds
                        latencies = lat if lat is not None else latencies
                if bar:
                    bar.advance(task)
        finally:
            tier.close()
    finally:
        parent.send("stop")
        server.join(30)
        if server.is_alive():
            server.kill()
    total = chunk * count
    lat_ms = sorted(1e3 * s for s in latencies)
    return P2PBenchResult(chunk, count, concurrency, total / best["p2p"] / 1e9,
                          total / best["raw"] / 1e9, total / best["zmq"] / 1e9,
                          statistics.median(lat_ms), lat_ms[min(len(lat_ms) - 1,
                                                                int(0.99 * len(lat_ms)))])


def run(args: argparse.Namespace) -> int:
    """Run `kvhal bench p2p` and print the table (or JSON); exit 1 below the target ratio."""
    with progress(disable=args.json) as bar:
        result = measure(args.chunk_bytes, args.count, args.concurrency, args.repeats, bar)
    ok = result.ratio >= TARGET_RATIO
    if args.json:
        print_json(asdict(result) | {"ratio": result.ratio, "target_ratio": TARGET_RATIO,
                                     "zmq_ratio": result.zmq_gbps / result.raw_tcp_gbps})
    else:
        print_table(f"kvhal bench p2p — {result.count} × {result.chunk_bytes} B chunks, "
                    f"{result.concurrency} threads, two processes on loopback (GB/s)",
                    ["path", "GB/s", "× raw TCP"],
                    [["p2p tier (checked)", round(result.p2p_gbps, 3), round(result.ratio, 2)],
                     ["raw TCP loop", round(result.raw_tcp_gbps, 3), 1.0],
                     ["zmq frames", round(result.zmq_gbps, 3),
                      round(result.zmq_gbps / result.raw_tcp_gbps, 2)]])
        print(f"p2p per-chunk latency: p50 {result.p2p_p50_ms:.2f} ms, "
              f"p99 {result.p2p_p99_ms:.2f} ms; target p2p >= {TARGET_RATIO} x raw TCP: "
              f"{'met' if ok else 'NOT met'}")
    return 0 if ok else 1


def register(sub: argparse._SubParsersAction) -> None:
    """Add `kvhal bench p2p`."""
    p = sub.add_parser("p2p", help="p2p pull throughput between two processes vs raw TCP/zmq")
    p.add_argument("--chunk-bytes", type=_size, default=2 << 20, help="e.g. 2MiB (default)")
    p.add_argument("--count", type=positive_int, default=64, help="chunks per pass (default 64)")
    p.add_argument("--concurrency", type=positive_int, default=4,
                   help="pull threads and connections (default 4)")
    p.add_argument("--repeats", type=positive_int, default=3, help="passes; best is reported")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
