"""`kvhal bench tier --tier mooncake`: the raw Mooncake loops the mooncake tier is measured
against, and the latency of one chunk.

Without a `master_server_address` in `--config`, the run starts a local pool: a
`mooncake_master` and a `mooncake_client` process lending the pool's memory (`SegmentKeeper`,
sized for every pass of every contender), so that every transfer crosses a process boundary
over loopback TCP as it would to a remote node; the tier and the raw loops lend none. Two raw
loops, each its own client with the host region registered, on the tier's threads (loads: 2 x
`io_threads`, as the tier's store threads also load while no store is queued; stores:
`io_threads`), in batches of the tier's `MAX_BATCH` chunks, no header, no checks:

- "raw put_from/get_into": the tier's own calls (`batch_put_from_multi_buffers`,
  `batch_get_into_multi_buffers`) straight between the pool and each chunk's host slot;
- "raw put/get": the unregistered path (`put_batch` of the slots, `get_batch` into bytes then
  copied into the slots; its client's local buffer sized to stage every batch in flight):
  what the registered path gains.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

from kvhal.keys import ChunkKey
from kvhal.tiers.base import JobKind, TierJob
from kvhal.tiers.chunk_format import record_nbytes

#: Single-chunk transfers timed per contender and direction for the latency line.
LATENCY_CHUNKS = 32


@contextlib.contextmanager
def pool_config(config: dict, chunk: int, count: int, repeats: int) -> Iterator[dict]:
    """`config` naming a pool: the caller's, or a local master and keeper started for the
    `with` block, the keeper lending room for every pass of three contenders plus the latency
    chunks (x 1.25 for the master's allocator)."""
    if "master_server_address" in config:
        yield config
        return
    from kvhal.tiers.mooncake.local_master import LocalMaster, SegmentKeeper
    room = record_nbytes(chunk) * (3 * (repeats * count + 2 * LATENCY_CHUNKS))
    with LocalMaster({"eviction_high_watermark_ratio": "0.95"}) as master:
        keeper = SegmentKeeper(master, int(room * 1.25) + (64 << 20)).start()
        try:
            yield master.tier_config(global_segment_size=0) | config
        finally:
            keeper.kill()


class _RawMooncakeLoop:
    """One raw loop as a bench contender (`write(rep)`, `read(rep)`, `close()`)."""

    durability = "pool"
    o_direct = False

    def __init__(self, name: str, config: dict, host: memoryview, chunk: int, count: int,
                 threads: tuple[int, int], batch: int, registered: bool) -> None:
        from kvhal.tiers.mooncake.client import connect, register, replicate_config
        from kvhal.tiers.mooncake.config import parse_config
        if not registered:  # plain put/get stage every byte in the client's local buffer
            need = 2 * max(threads) * batch * chunk
            config = config | {"local_buffer_size": max(need, config.get("local_buffer_size",
                                                                         0))}
        cfg = parse_config(config)
        self.name, self.host, self.chunk, self.count = name, host, chunk, count
        self.threads, self._batch, self._registered = threads, batch, registered
        self._client = connect(cfg)
        self._base = register(self._client, host, "host")
        self._replicate = replicate_config(cfg.replica_num)
        self._pools = (ThreadPoolExecutor(threads[0]), ThreadPoolExecutor(threads[1]))
        self._prefix = f"bench-raw/{os.getpid()}/{name.split()[1]}"

    def _batches(self) -> list[range]:
        return [range(i, min(i + self._batch, self.count))
                for i in range(0, self.count, self._batch)]

    def _names(self, rep: int, part: range) -> list[str]:
        return [f"{self._prefix}/{rep}/{i}" for i in part]

    def put(self, rep: int, part: range) -> None:
        """Store chunks `part` of pass `rep` in one call.

        Raises:
            RuntimeError: the pool refused one.
        """
        names = self._names(rep, part)
        if self._registered:
            codes = self._client.batch_put_from_multi_buffers(
                names, [[self._base + i * self.chunk] for i in part],
                [[self.chunk] for _ in part], self._replicate)
        else:
            rc = self._client.put_batch(names, [self.host[i * self.chunk:(i + 1) * self.chunk]
                                                for i in part], self._replicate)
            codes = [rc]
        if any(c != 0 for c in codes):
            raise RuntimeError(f"{self.name}: put failed: {codes}")

    def get(self, rep: int, part: range) -> None:
        """Load chunks `part` of pass `rep` into their slots in one call.

        Raises:
            RuntimeError: a get failed or came back short.
        """
        names = self._names(rep, part)
        if self._registered:
            got = self._client.batch_get_into_multi_buffers(
                names, [[self._base + i * self.chunk] for i in part],
                [[self.chunk] for _ in part])
            if any(n != self.chunk for n in got):
                raise RuntimeError(f"{self.name}: get failed: {got}")
            return
        for i, body in zip(part, self._client.get_batch(names)):
            if len(body) != self.chunk:
                raise RuntimeError(f"{self.name}: get of chunk {i} returned {len(body)} bytes")
            self.host[i * self.chunk:(i + 1) * self.chunk] = body

    def write(self, rep: int) -> None:
        list(self._pools[1].map(lambda part: self.put(rep, part), self._batches()))

    def read(self, rep: int) -> None:
        list(self._pools[0].map(lambda part: self.get(rep, part), self._batches()))

    def close(self) -> None:
        for pool in self._pools:
            pool.shutdown()
        self._client.unregister_buffer(self._base)
        self._client.close()


def raw_contenders(config: dict, host: memoryview, chunk: int, count: int,
                   threads: tuple[int, int]) -> list:
    """The registered and the plain raw loop for the mooncake tier of `config`."""
    from kvhal.tiers.mooncake.tier import MAX_BATCH
    return [_RawMooncakeLoop(name, config, host, chunk, count, threads, MAX_BATCH, registered)
            for name, registered in (("raw put_from/get_into", True),
                                     ("raw put/get", False))]


def latency_us(tier, namespace: bytes, raws: list, chunk: int) -> dict[str, dict[str, float]]:
    """Median microseconds of one chunk stored, then loaded, alone (no other transfer in
    flight), per contender: {"kvhal mooncake": {"store": .., "load": .., "samples": n},
    ...}. The kvhal
    figure is submit to `drain` (the job's whole path, checksum and verification included)."""
    count = min(LATENCY_CHUNKS, len(tier._host) // chunk)
    out: dict[str, dict[str, float]] = {}
    times: dict[str, list[float]] = {"store": [], "load": []}
    for kind, name in ((JobKind.STORE, "store"), (JobKind.LOAD, "load")):
        for i in range(count):
            job = TierJob(i, kind, ChunkKey(namespace, 1, i.to_bytes(32, "big")), i * chunk,
                          chunk)
            t0 = time.perf_counter()
            (tier.submit_store if kind is JobKind.STORE else tier.submit_load)(job)
            tier.drain()
            times[name].append(time.perf_counter() - t0)
        failed = [r for r in tier.get_finished_jobs() if not r.ok]
        if failed:
            raise RuntimeError(f"latency {name}: {failed[0].error}")
    out["kvhal mooncake"] = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    out["kvhal mooncake"]["samples"] = count
    for raw in raws:
        samples: dict[str, list[float]] = {"store": [], "load": []}
        for name, call in (("store", raw.put), ("load", raw.get)):
            for i in range(count):
                t0 = time.perf_counter()
                call(-2, range(i, i + 1))
                samples[name].append(time.perf_counter() - t0)
        out[raw.name] = {k: statistics.median(v) * 1e6 for k, v in samples.items()}
        out[raw.name]["samples"] = count
    return out
