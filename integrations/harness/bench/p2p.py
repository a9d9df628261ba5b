"""`kvhal bench p2p`: pull throughput of the p2p tier between two processes vs raw loops.

The serving process holds `--count` chunks of `--chunk-bytes` (seeded random bytes) in the
host region of a real engine manager, as a serving instance does: its p2p tier is attached and
serves straight from the host slots (slot pinned, xxh3-128 taken before sending). The same
slots are also served by a raw TCP server (request: an 8-byte chunk index; reply: the chunk's
bytes by `sendall`) and a zmq ROUTER (reply: the chunk as one zero-copy frame). The measuring
process pulls every chunk with `--concurrency` threads, each with its own connection: through
a p2p tier (peers = the server; key, length and xxh3-128 checked), by the raw TCP loop
(`recv_into` the destination, nothing checked) and over zmq DEALER sockets (`recv_into`).

Passes alternate (raw, p2p, zmq, then p2p, raw, zmq, ...) so that both see the same load
drifts; each figure is the median over `--repeats` passes and the ratio is the median of the
per-repeat ratios p2p / raw (two passes next to each other in time), which is what stays put
on a loaded machine. CPU time per chunk of both processes (user + system, /proc) is reported
per kind too (all passes of a kind together: /proc counts 10 ms ticks): it is what the code
costs, less noisy than wall time. The p2p per-chunk latency
(p50, p99) is the job wall time over all p2p passes; next to it, the wall time of one xxh3-128
digest of a chunk, which the serving side takes per pull of a host slot (host slots keep no
digest). Target: p2p >= 0.9 x raw TCP.

A second row, P/D (`p2p_pd.py`), times prefill/decode disaggregation over the p2p tier: from
a simulated chunked prefill's last chunk (`--prefill-ms-per-chunk` of compute each) to the
decoder holding every chunk, against the raw TCP loop moving the same bytes after the prefill,
and the share of the transfer hidden behind the prefill.
"""
from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np
import xxhash

from kvhal.argtypes import non_negative_float, positive_int
from kvhal.report import print_json, print_table, progress

from . import links, p2p_pd
from .copy import _size
from .p2p_loops import (AUTH_KEY, INDEX, NAMESPACE, RawTcp, chunk_key, connected, cpu_s,
                        finish_pulls, payload, run_threads, serve_raw_tcp, serving,
                        submit_pulls)

TARGET_RATIO = 0.9


@dataclass(frozen=True, slots=True)
class P2PBenchResult:
    """Throughputs in GB/s (1e9 B/s) of payload bytes, medians over the passes; latencies
    in milliseconds; CPU in milliseconds per chunk (user + system) of the pulling (client)
    and serving (server) process, over all passes of a kind.

    Attributes:
        ratio: Median over repeats of p2p / raw TCP throughput of the same repeat.
        hash_ms_per_chunk: Wall milliseconds of one xxh3-128 digest of a chunk, median over
            the repeats (timed in the pulling process after each repeat's passes): what the
            serving side adds to a pull of a host slot, which keeps no digest.
    """

    chunk_bytes: int
    count: int
    concurrency: int
    repeats: int
    p2p_gbps: float
    raw_tcp_gbps: float
    zmq_gbps: float
    ratio: float
    p2p_p50_ms: float
    p2p_p99_ms: float
    cpu_ms_per_chunk: dict
    hash_ms_per_chunk: float


def _serve_zmq(sock, data: memoryview, offsets: list[int], chunk: int) -> None:
    import zmq
    while True:
        try:
            ident, index = sock.recv_multipart()
        except zmq.ZMQError:
            return
        (i,) = INDEX.unpack(index)
        sock.send_multipart([ident, data[offsets[i]:offsets[i] + chunk]], copy=False)


def _server(pipe, count: int, chunk: int) -> None:
    """Serving process body: a manager's host region with an attached p2p tier, plus raw
    TCP and zmq servers over the same slots."""
    import zmq

    from kvhal.engine.manager import Manager
    from kvhal.host.policy import LRUPolicy
    from kvhal.host.slots import SlotTable
    from kvhal.tiers.p2p import P2PTier
    region = np.empty(count * chunk, dtype=np.uint8)
    data = memoryview(region)
    tier = P2PTier({"auth_key": AUTH_KEY, "max_inflight": 64}, data, NAMESPACE)
    manager = Manager(SlotTable(count, LRUPolicy(count)), slot_bytes=chunk, chunk_nbytes=chunk,
                      tiers=[tier], emit_events=False)
    plan = manager.prepare_store([chunk_key(i) for i in range(count)])
    served = payload(count, chunk)
    offsets = [int(slot) * chunk for slot in plan.slots]
    for i, offset in enumerate(offsets):
        region[offset:offset + chunk] = served[i * chunk:(i + 1) * chunk]
    manager.complete_store(plan.job_id)
    manager.drain(600)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    zmq_port = router.bind_to_random_port("tcp://127.0.0.1")
    threading.Thread(target=_serve_zmq, args=(router, data, offsets, chunk),
                     daemon=True).start()
    pipe.send((tier.identity, serve_raw_tcp(data, offsets, chunk), zmq_port))
    pipe.recv()  # stop
    manager.close()


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
        s.send(INDEX.pack(i))
        if s.recv_into(self.out[i * self.chunk:(i + 1) * self.chunk]) != self.chunk:
            raise ConnectionError("zmq frame of another size")

    def teardown(self, s):
        s.close(linger=0)


def _hash_s(data: memoryview, count: int, chunk: int) -> float:
    """Wall seconds of the xxh3-128 digests of `count` chunks of `data`."""
    t0 = time.perf_counter()
    for i in range(count):
        xxhash.xxh3_128_digest(data[i * chunk:(i + 1) * chunk])
    return time.perf_counter() - t0


def _threads_pass(concurrency: int, count: int, work) -> float:
    """Wall seconds of `work`'s pulls of `count` chunks on `concurrency` connections made
    for the pass (untimed)."""
    with connected(work, concurrency) as states:
        return run_threads(states, count, work)


def _p2p_pass(tier, count: int, chunk: int) -> tuple[float, list[float]]:
    """Pull every chunk through `tier`: (wall seconds, each pull's job seconds)."""
    t0 = time.perf_counter()
    submit_pulls(tier, [chunk_key(i) for i in range(count)], chunk)
    results = finish_pulls(tier, count)
    return time.perf_counter() - t0, [r.seconds for r in results]


def measure(chunk: int, count: int, concurrency: int, repeats: int,
            bar=None) -> P2PBenchResult:
    """Run the benchmark (module docstring).

    Raises:
        RuntimeError: a pull failed or pulled bytes differ from the served ones.
    """
    from kvhal.tiers.p2p import P2PTier
    seconds: dict[str, list[float]] = {"p2p": [], "raw": [], "zmq": []}
    cpu: dict[str, list[tuple[float, float]]] = {"p2p": [], "raw": [], "zmq": []}
    latencies: list[float] = []
    hashing: list[float] = []
    with serving(_server, count, chunk) as (_, (identity, raw_port, zmq_port), server):
        out = np.zeros(count * chunk, dtype=np.uint8)
        view = memoryview(out)
        reference = payload(count, chunk)
        tier = P2PTier({"auth_key": AUTH_KEY, "peers": [identity], "num_threads": concurrency,
                        "timeout_s": 60.0}, view, NAMESPACE)
        raw, zmq_pull = RawTcp(raw_port, view, chunk), _Zmq(zmq_port, view, chunk)
        runs = {"raw": lambda: (_threads_pass(concurrency, count, raw), None),
                "zmq": lambda: (_threads_pass(concurrency, count, zmq_pull), None),
                "p2p": lambda: _p2p_pass(tier, count, chunk)}
        task = bar.add_task("bench p2p", total=repeats) if bar else None
        try:
            if not tier.wait_synced(60):
                raise RuntimeError("the p2p tier did not sync with the serving process")
            for r in range(repeats):
                for name in ("raw", "p2p", "zmq") if r % 2 == 0 else ("p2p", "raw", "zmq"):
                    out[:] = 0
                    before = cpu_s(os.getpid()), cpu_s(server.pid)
                    elapsed, lat = runs[name]()
                    cpu[name].append((cpu_s(os.getpid()) - before[0],
                                      cpu_s(server.pid) - before[1]))
                    if not np.array_equal(out, reference):
                        raise RuntimeError(f"{name} pass delivered wrong bytes")
                    seconds[name].append(elapsed)
                    latencies += lat or []
                hashing.append(_hash_s(view, count, chunk) / count)
                if bar:
                    bar.advance(task)
        finally:
            tier.close()
    total = chunk * count
    gbps = {name: total / statistics.median(s) / 1e9 for name, s in seconds.items()}
    ratio = statistics.median(raw / p2p for raw, p2p in zip(seconds["raw"], seconds["p2p"]))
    per_chunk = {name: {side: round(1e3 * sum(c[k] for c in pairs) / (count * len(pairs)), 3)
                        for k, side in enumerate(("client", "server"))}
                 for name, pairs in cpu.items()}  # totals: /proc counts 10 ms ticks
    lat_ms = sorted(1e3 * s for s in latencies)
    return P2PBenchResult(chunk, count, concurrency, repeats, gbps["p2p"], gbps["raw"],
                          gbps["zmq"], ratio, statistics.median(lat_ms),
                          lat_ms[min(len(lat_ms) - 1, int(0.99 * len(lat_ms)))], per_chunk,
                          1e3 * statistics.median(hashing))


def run(args: argparse.Namespace) -> int:
    """Run `kvhal bench p2p` and print the tables (or JSON); exit 1 below the target ratio.

    Raises:
        ValueError: the prefill of `--count` chunks at `--prefill-ms-per-chunk` would outlast
            half of the decoder's wait for a chunk (`p2p_pd.FETCH_WAIT_S`).
    """
    if args.link:
        return _run_on_links(args)
    prefill_s = args.count * args.prefill_ms_per_chunk / 1e3
    if prefill_s > p2p_pd.FETCH_WAIT_S / 2:
        raise ValueError(f"--prefill-ms-per-chunk {args.prefill_ms_per_chunk:g} x --count "
                         f"{args.count}: a prefill of {prefill_s:.0f} s, over the "
                         f"{p2p_pd.FETCH_WAIT_S / 2:.0f} s the P/D row allows")
    with progress(disable=args.json) as bar:
        result = measure(args.chunk_bytes, args.count, args.concurrency, args.repeats, bar)
        pd = p2p_pd.measure(args.chunk_bytes, args.count, args.concurrency, args.repeats,
                            args.prefill_ms_per_chunk, bar)
    ok = result.ratio >= TARGET_RATIO
    if args.json:
        print_json(asdict(result) | {"target_ratio": TARGET_RATIO,
                                     "zmq_ratio": result.zmq_gbps / result.raw_tcp_gbps,
                                     "pd": asdict(pd)})
    else:
        cpu = result.cpu_ms_per_chunk
        print_table(f"kvhal bench p2p — {result.count} × {result.chunk_bytes} B chunks, "
                    f"{result.concurrency} threads, two processes on loopback, medians of "
                    f"{result.repeats} alternating passes",
                    ["path", "GB/s", "× raw TCP", "CPU ms/chunk pull", "CPU ms/chunk serve"],
                    [["p2p tier (checked)", round(result.p2p_gbps, 3), round(result.ratio, 2),
                      cpu["p2p"]["client"], cpu["p2p"]["server"]],
                     ["raw TCP loop", round(result.raw_tcp_gbps, 3), 1.0,
                      cpu["raw"]["client"], cpu["raw"]["server"]],
                     ["zmq frames", round(result.zmq_gbps, 3),
                      round(result.zmq_gbps / result.raw_tcp_gbps, 2),
                      cpu["zmq"]["client"], cpu["zmq"]["server"]]])
        print(f"p2p per-chunk latency: p50 {result.p2p_p50_ms:.2f} ms, "
              f"p99 {result.p2p_p99_ms:.2f} ms; target p2p >= {TARGET_RATIO} x raw TCP "
              f"(median of per-repeat ratios): {'met' if ok else 'NOT met'}")
        print(f"xxh3-128 of one chunk (the serving side's digest of a host slot per pull): "
              f"{result.hash_ms_per_chunk:.3f} ms")
        print_table(f"P/D — prefill of {result.count} chunks at {pd.prefill_ms_per_chunk:g} ms "
                    f"of compute each, medians of {result.repeats} alternating passes",
                    ["path", "prefill ms", "tail ms (last chunk stored → decoder has all)",
                     "prefill + tail ms", "× raw TCP tail"], p2p_pd.table_rows(pd))
        print(f"overlap: {pd.overlap:.2f} of the p2p transfer hidden behind the prefill "
              f"(1 − decode-leg-first tail / prefill-leg-first tail, per-repeat geometric "
              f"mean); the streamed prefill took {pd.prefill_ms['pd']:.1f} ms, "
              f"{pd.prefill_ms['after']:.1f} ms with the prefill leg first (the transfers it "
              f"overlaps share this machine's CPU): 'prefill + tail' is the whole cost")
    return 0 if ok else 1


def _run_on_links(args: argparse.Namespace) -> int:
    """`--link`: the bench inside each emulated link (`links.run_on_links`), one row per link
    and the crossover; exit 1 if the slowest link is already below the target ratio."""
    argv = ["bench", "p2p", "--chunk-bytes", str(args.chunk_bytes), "--count", str(args.count),
            "--concurrency", str(args.concurrency), "--repeats", str(args.repeats),
            "--prefill-ms-per-chunk", str(args.prefill_ms_per_chunk)]
    runs = links.run_on_links(argv, args.link)
    best = links.crossover([(s.rate_bps, r["ratio"]) for s, r in runs], TARGET_RATIO)
    if args.json:
        print_json({"links": [{"link": s.label, "rate_bps": s.rate_bps, "rtt_s": s.rtt_s, **r}
                              for s, r in runs],
                    "target_ratio": TARGET_RATIO, "crossover_bps": best})
    else:
        rows = [[s.label, round(r["p2p_gbps"], 3), round(r["raw_tcp_gbps"], 3),
                 round(r["ratio"], 3), round(r["pd"]["tail_ms"]["pd"], 2),
                 round(r["pd"]["tail_vs_raw"]["pd"], 2)] for s, r in runs]
        print_table(f"kvhal bench p2p on emulated links — {args.count} × {args.chunk_bytes} B "
                    f"chunks, {args.concurrency} threads, both processes in a network "
                    f"namespace whose loopback runs at the link's rate (tc tbf), medians of "
                    f"{args.repeats} alternating passes",
                    ["link", "p2p GB/s (checked)", "raw TCP GB/s", "× raw TCP",
                     "P/D tail ms (decode leg first)", "P/D tail × raw"], rows)
        print(f"crossover: verified pulls stay >= {TARGET_RATIO} x raw TCP up to "
              f"{links.LinkSpec(best).label}" if best else
              f"crossover: verified pulls are below {TARGET_RATIO} x raw TCP at every link "
              f"measured")
    return 0 if best else 1


def register(sub: argparse._SubParsersAction) -> None:
    """Add `kvhal bench p2p`."""
    p = sub.add_parser("p2p", help="p2p pull throughput between two processes vs raw TCP/zmq")
    p.add_argument("--chunk-bytes", type=_size, default=2 << 20, help="e.g. 2MiB (default)")
    p.add_argument("--count", type=positive_int, default=64, help="chunks per pass (default 64)")
    p.add_argument("--concurrency", type=positive_int, default=4,
                   help="pull threads and connections (default 4)")
    p.add_argument("--repeats", type=positive_int, default=7,
                   help="alternating passes of each kind; medians are reported (default 7)")
    p.add_argument("--prefill-ms-per-chunk", type=non_negative_float, default=2.0,
                   help="P/D row: simulated prefill compute per chunk, ms (default 2): your "
                        "model's prefill ms per token x tokens per chunk")
    links.add_link_option(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
