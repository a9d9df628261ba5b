"""`kvhal bench tier --tier mooncake`: the raw Mooncake loops the mooncake tier is measured
against, and the latency of one chunk.

Without a `master_server_address` in `--config`, the run starts a local pool: a
`mooncake_master` and a `mooncake_client` process lending the pool's memory (`SegmentKeeper`,
sized for two passes of every contender: each pass's objects are removed once read), so that
every transfer crosses a process boundary over loopback TCP as it would to a remote node; the
tier and the raw loops lend none. Three raw loops, each its own client with the host region
registered, on the tier's threads (loads: 2 x `io_threads`, as the tier's store threads also
load while no store is queued; stores: `io_threads`), in batches of the tier's `MAX_BATCH`
chunks, no checks:

- "raw put_from/get_into": the tier's own calls (`batch_put_from_multi_buffers`,
  `batch_get_into_multi_buffers`) straight between the pool and each chunk's host slot;
- "raw put/get": the unregistered path (`put_batch` of the slots, `get_batch` into bytes then
  copied into the slots; its client's local buffer sized to stage every batch in flight):
  what the registered path gains;
- "raw +header": the first loop moving the tier's object shape, a chunk record (a 4 KiB
  header buffer, unfilled, then the slot, then the padding, as `MooncakeTier._buffers`):
  what the record's separate header buffer costs, apart from kvhal's checks.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

from kvhal.keys import ChunkKey
from kvhal.tier import JobKind, TierJob
from kvhal.tiers.chunk_format import ALIGN, HEADER_BYTES, record_nbytes

#: Single-chunk transfers timed per contender and direction for the latency line.
LATENCY_CHUNKS = 32


@contextlib.contextmanager
def pool_config(config: dict, chunk: int, count: int, repeats: int) -> Iterator[dict]:
    """`config` naming a pool: the caller's, or a local master and keeper started for the
    `with` block, the keeper lending room for two passes of four contenders plus the latency
    chunks (x 1.25 for the master's allocator): each pass's objects are removed once read
    (`forget_pass`), so `repeats` does not size it."""
    if "master_server_address" in config:
        yield config
        return
    from kvhal.tiers.mooncake.local_master import LocalMaster, SegmentKeeper
    room = record_nbytes(chunk) * (4 * (2 * count + 2 * LATENCY_CHUNKS))
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

    def __init__(self, name: str, config: dict, host: memoryview, chunk: int, stride: int,
                 count: int, threads: tuple[int, int], batch: int, registered: bool,
                 header: bool = False) -> None:
        from kvhal.tiers.mooncake.client import connect, register, replicate_config
        from kvhal.tiers.mooncake.config import parse_config
        if not registered:  # plain put/get stage every byte in the client's local buffer
            need = 2 * max(threads) * batch * chunk
            config = config | {"local_buffer_size": max(need, config.get("local_buffer_size",
                                                                         0))}
        cfg = parse_config(config)
        self.name, self.host, self.chunk, self.count = name, host, chunk, count
        self.stride = stride        # chunk i at byte i * stride of `host`
        self.threads, self._batch, self._registered = threads, batch, registered
        self._client = connect(cfg)
        self._base = register(self._client, host, "host")
        self._registered_ptrs = [self._base]
        self._pad = record_nbytes(chunk) - HEADER_BYTES - chunk
        if header:   # one header per chunk of a batch, then the padding (never read)
            self._scratch = memoryview(bytearray(batch * HEADER_BYTES + ALIGN))
            self._registered_ptrs.append(register(self._client, self._scratch, "scratch"))
        self._header = header
        self._replicate = replicate_config(cfg.replica_num)
        self._pools = (ThreadPoolExecutor(threads[0]), ThreadPoolExecutor(threads[1]))
        self._prefix = f"bench-raw/{os.getpid()}/{name.split()[1]}"

    def _batches(self) -> list[range]:
        return [range(i, min(i + self._batch, self.count))
                for i in range(0, self.count, self._batch)]

    def _names(self, rep: int, part: range) -> list[str]:
        return [f"{self._prefix}/{rep}/{i}" for i in part]

    def _slot(self, i: int) -> memoryview:
        """Chunk i's bytes in the host region."""
        return self.host[i * self.stride:i * self.stride + self.chunk]

    def _buffers(self, part: range) -> tuple[list[list[int]], list[list[int]]]:
        """(addresses, sizes) of each chunk of `part`: its slot, or with `header` a chunk
        record's buffers (header, slot, padding)."""
        if not self._header:
            return ([[self._base + i * self.stride] for i in part],
                    [[self.chunk] for _ in part])
        scratch = self._registered_ptrs[1]
        pad = [scratch + self._batch * HEADER_BYTES] if self._pad else []
        ptrs = [[scratch + n * HEADER_BYTES, self._base + i * self.stride, *pad]
                for n, i in enumerate(part)]
        sizes = [[HEADER_BYTES, self.chunk] + ([self._pad] if self._pad else []) for _ in part]
        return ptrs, sizes

    def put(self, rep: int, part: range) -> None:
        """Store chunks `part` of pass `rep` in one call.

        Raises:
            RuntimeError: the pool refused one.
        """
        names = self._names(rep, part)
        if self._registered:
            codes = self._client.batch_put_from_multi_buffers(names, *self._buffers(part),
                                                              self._replicate)
        else:
            rc = self._client.put_batch(names, [self._slot(i) for i in part], self._replicate)
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
            got = self._client.batch_get_into_multi_buffers(names, *self._buffers(part))
            want = record_nbytes(self.chunk) if self._header else self.chunk
            if any(n != want for n in got):
                raise RuntimeError(f"{self.name}: get failed: {got}")
            return
        for i, body in zip(part, self._client.get_batch(names)):
            if len(body) != self.chunk:
                raise RuntimeError(f"{self.name}: get of chunk {i} returned {len(body)} bytes")
            self._slot(i)[:] = body

    def write(self, rep: int) -> None:
        list(self._pools[1].map(lambda part: self.put(rep, part), self._batches()))

    def read(self, rep: int) -> None:
        list(self._pools[0].map(lambda part: self.get(rep, part), self._batches()))

    def forget(self, rep: int) -> None:
        """Remove pass `rep`'s objects from the pool (untimed, between passes)."""
        _removed(self._client, self._names(rep, range(self.count)), self.name)

    def close(self) -> None:
        for pool in self._pools:
            pool.shutdown()
        for ptr in self._registered_ptrs:
            self._client.unregister_buffer(ptr)
        self._client.close()


def _removed(client, names: list[str], who: str) -> None:
    """Remove the objects `names` with `client`.

    Raises:
        RuntimeError: the pool refused a removal (other than "not found").
    """
    from kvhal.tiers.mooncake.client import GONE, error_name
    codes = client.batch_remove(names, True)
    bad = [c for c in codes if c != 0 and c not in GONE]
    if bad:
        raise RuntimeError(f"{who}: removing a pass's objects failed: {error_name(bad[0])}")


def forget_pass(contenders: list, rep: int) -> None:
    """Remove every contender's objects of pass `rep` (`contenders[0]` the kvhal tier): each
    pass then writes into pool memory a previous pass used, as in a long-running pool, not
    into memory the keeper touches for the first time. Measured (2 MiB chunks, 2-core VM):
    with every pass in fresh memory all three contenders wrote 0.5-0.8 GB/s, and with
    `--repeats 12` the keeper's 23 GiB segment outgrew RAM and writes fell to ~0.1 GB/s after
    pass 5; with reuse they write 1.0-2.1 GB/s after the first pass."""
    kvhal = contenders[0]
    _removed(kvhal.tier._client, [kvhal.tier.object_name(k) for k in kvhal.keys(rep)],
             kvhal.name)
    for raw in contenders[1:]:
        raw.forget(rep)


def raw_contenders(config: dict, host: memoryview, chunk: int, stride: int, count: int,
                   threads: tuple[int, int]) -> list:
    """The registered, the plain and the record-shaped raw loop for the mooncake tier of
    `config` (module docstring), in that order."""
    from kvhal.tiers.mooncake.tier import MAX_BATCH
    return [_RawMooncakeLoop(name, config, host, chunk, stride, count, threads, MAX_BATCH,
                             registered, header)
            for name, registered, header in (("raw put_from/get_into", True, False),
                                             ("raw put/get", False, False),
                                             ("raw +header", True, True))]


def latency_us(tier, namespace: bytes, raws: list, chunk: int, stride: int
               ) -> dict[str, dict[str, float]]:
    """Median microseconds of one chunk stored, then loaded, alone (no other transfer in
    flight), per contender: {"kvhal mooncake": {"store": .., "load": .., "samples": n},
    ...}; chunk i at byte `i * stride`. The kvhal figure is submit to `drain` (the job's whole
    path, checksum and verification included)."""
    count = min(LATENCY_CHUNKS, len(tier._host) // stride)
    out: dict[str, dict[str, float]] = {}
    times: dict[str, list[float]] = {"store": [], "load": []}
    for kind, name in ((JobKind.STORE, "store"), (JobKind.LOAD, "load")):
        for i in range(count):
            job = TierJob(i, kind, ChunkKey(namespace, 1, i.to_bytes(32, "big")), i * stride,
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
