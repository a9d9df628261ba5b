"""What both rows of `kvhal bench p2p` share: the serving process's start and stop, the raw
TCP loop both sides of it, p2p pulls through a tier, the payload and keys, CPU clocks.

The raw TCP loop is the baseline: request an 8-byte chunk index, reply the chunk's bytes by
`sendall` from the host region (at `offsets[index]`), received by `recv_into` straight into
the destination; nothing is checked.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import socket
import struct
import threading
import time
from typing import Hashable, Iterator, Sequence

import numpy as np

from kvhal.keys import ChunkKey

NAMESPACE = b"kvhal-bench-p2p!"
AUTH_KEY = "kvhal-bench-p2p-shared-key"
INDEX = struct.Struct("<Q")
#: Longest wait (seconds) for the serving process to start or to answer one command.
SERVER_WAIT_S = 600


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (/proc/PID/stat fields 14, 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def payload(count: int, chunk: int) -> np.ndarray:
    """The bench's bytes: `count` chunks of `chunk` bytes, seeded (the same in every process)."""
    return np.random.default_rng(0).integers(0, 256, count * chunk, dtype=np.uint8)


def chunk_key(i: int, batch: int = 0) -> ChunkKey:
    """Key of chunk `i` of `batch` (a pass that stores its chunks afresh uses its own batch)."""
    return ChunkKey(NAMESPACE, 0, ((batch << 32) | i).to_bytes(8, "big"))


def recv_answer(pipe, what: str):
    """The serving process's next message on `pipe`, within `SERVER_WAIT_S`.

    Raises:
        RuntimeError: none came (names `what` was awaited), or it is an exception the serving
            process sent instead.
    """
    if not pipe.poll(SERVER_WAIT_S):
        raise RuntimeError(f"the serving process did not answer: {what}")
    answer = pipe.recv()
    if isinstance(answer, BaseException):
        raise RuntimeError(f"the serving process failed: {answer!r}")
    return answer


@contextlib.contextmanager
def serving(target, *args) -> Iterator[tuple[object, object, multiprocessing.Process]]:
    """Run `target(pipe, *args)` in a spawned process; yield (pipe, its first message, the
    process). On exit send None (stop), join it (30 s) and kill it if it is still alive."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    server = ctx.Process(target=target, args=(child, *args), daemon=True)
    server.start()
    try:
        yield parent, recv_answer(parent, "start"), server
    finally:
        with contextlib.suppress(OSError):
            parent.send(None)
        server.join(30)
        if server.is_alive():
            server.kill()
            server.join(30)


def _serve_raw(conn: socket.socket, data: memoryview, offsets: Sequence[int],
               chunk: int) -> None:
    with conn:
        while True:
            header = conn.recv(INDEX.size, socket.MSG_WAITALL)
            if len(header) < INDEX.size:
                return
            (i,) = INDEX.unpack(header)
            conn.sendall(data[offsets[i]:offsets[i] + chunk])


def serve_raw_tcp(data: memoryview, offsets: Sequence[int], chunk: int) -> int:
    """Serve the raw TCP loop on 127.0.0.1 (daemon threads, one per connection): chunk i is
    `data[offsets[i]:offsets[i] + chunk]` at the time it is asked for (`offsets` may be
    changed in place between passes). Returns the port."""
    listener = socket.create_server(("127.0.0.1", 0))

    def accept():
        while True:
            conn, _ = listener.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=_serve_raw, args=(conn, data, offsets, chunk),
                             daemon=True).start()
    threading.Thread(target=accept, daemon=True).start()
    return listener.getsockname()[1]


@contextlib.contextmanager
def connected(work, concurrency: int) -> Iterator[list]:
    """`concurrency` states from `work.setup()` (e.g. connections), each closed by
    `work.teardown(state)` on exit."""
    states = [work.setup() for _ in range(concurrency)]
    try:
        yield states
    finally:
        for s in states:
            work.teardown(s)


def run_threads(states: Sequence, count: int, work) -> float:
    """Run `work(state, i)` for i < count on one thread per state of `states` (from
    `connected`); return the wall seconds.

    Raises:
        RuntimeError: a call of `work` raised (the first such error).
    """
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in range(count):
        todo.put(i)
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
    if errors:
        raise RuntimeError(f"raw pull failed: {errors[0]!r}")
    return elapsed


class RawTcp:
    """The raw loop's pulling side, for `connected` and `run_threads`: chunk i lands at
    `out[i * chunk:]`."""

    def __init__(self, port: int, out: memoryview, chunk: int):
        self.port, self.out, self.chunk = port, out, chunk

    def setup(self):
        s = socket.create_connection(("127.0.0.1", self.port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return s

    def __call__(self, s, i):
        s.sendall(INDEX.pack(i))
        view, done = self.out[i * self.chunk:(i + 1) * self.chunk], 0
        while done < self.chunk:
            n = s.recv_into(view[done:], self.chunk - done)
            if n == 0:
                raise ConnectionError("raw server closed")
            done += n

    def teardown(self, s):
        s.close()


def submit_pulls(tier, keys: Sequence[ChunkKey], chunk: int,
                 request: Hashable | None = None) -> None:
    """Submit a load of each of `keys` to the p2p `tier`, key i into host bytes
    [i * chunk, (i + 1) * chunk), for `request` (a context the tier took part in) or none."""
    from kvhal.tier import JobKind, TierJob
    for i, key in enumerate(keys):
        tier.submit_load(TierJob(i, JobKind.LOAD, key, i * chunk, chunk, request_id=request))


def finish_pulls(tier, count: int) -> list:
    """Wait (600 s at most) for the tier's `count` pulls; return their `JobResult`s.

    Raises:
        RuntimeError: a pull failed, or another number of results came.
    """
    tier.drain(600)
    results = tier.get_finished_jobs()
    failed = [r for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} p2p pulls failed, first: {failed[0].error}")
    if len(results) != count:
        raise RuntimeError(f"{len(results)} p2p pull results for {count} pulls")
    return results
