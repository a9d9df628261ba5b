"""The P/D row of `kvhal bench p2p`: what prefill/decode disaggregation over the p2p tier adds
to the time to first token, against the raw TCP loop moving the same bytes after the prefill.

The prefilling process runs an engine manager whose host tier the p2p tier is attached to, as
a prefill instance. Each pass is a simulated chunked prefill of `--count` fresh chunks: chunk
i is "computed" by sleeping until `start + (i + 1) × --prefill-ms-per-chunk` (the accelerator
computes while the host CPU idles; a store never delays the next chunk's compute, as with
asynchronous D2H copies), then its bytes are written into a fresh host slot and stored
(`prepare_store`, `complete_store`), which parks it under the pass's kv_request_id at once.
The decoding process (the measuring one) pulls the pass's chunks, `--concurrency` at a time,
into its own host region, and every pass's bytes are checked. Three kinds of pass, in an
order rotated every repeat so that each sees the same load drifts:

- `pd`, decode leg first: the decoder opens its `remote_prefiller` leg and submits every pull,
  and the prefill starts once its first pulls wait at the prefiller: chunks stream to the
  decoder as they are stored, their transfer overlapping the prefill's compute;
- `after`, prefill leg first: the decoder opens its leg once the prefill leg ended: the p2p
  transfer of all the chunks with nothing to hide it behind;
- `raw`: the prefill parks nothing; once it ended, the raw TCP loop moves the same bytes
  (the no-overlap baseline, nothing checked).

Per pass, in milliseconds: `prefill_ms`, from the first chunk's compute start to the last
chunk stored, and `tail_ms`, from the last chunk stored to the decoder holding every chunk:
what P/D adds to the time to first token; and their sum, `end_to_end_ms` (the first chunk's
compute start to the decoder holding every chunk), which also counts a prefill slowed by the
transfers it overlaps (here they share the CPU with its stores). Stamps are
`time.monotonic()` (CLOCK_MONOTONIC, one clock for every process of a Linux machine), taken
by the prefiller and the decoder.
Ratios are geometric means over the repeats of the ratio of passes of one repeat:
`tail_vs_raw` = pd tail / raw tail, and `overlap` = 1 − pd tail / after tail, the share of
the p2p transfer hidden behind the prefill (negative if streaming made the tail longer than
the whole transfer alone).
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass

import numpy as np

from .p2p_loops import (AUTH_KEY, NAMESPACE, RawTcp, chunk_key, connected, finish_pulls,
                        payload, recv_answer, run_threads, serve_raw_tcp, serving,
                        submit_pulls)

#: Kinds of pass (module docstring), in the first repeat's order.
KINDS = ("pd", "after", "raw")
#: Longest a pull waits for its chunk to be stored (the decoder's `fetch_wait_s`, its
#: maximum): a prefill of `--count` chunks at the pace must end well within it.
FETCH_WAIT_S = 600.0
#: Longest a prefill waits for the decode leg's first pulls to reach the prefiller (seconds).
PULLS_WAIT_S = 60.0


@dataclass(frozen=True, slots=True)
class PDBenchResult:
    """The P/D row (module docstring); times in milliseconds.

    Attributes:
        prefill_ms_per_chunk: The simulated compute per chunk asked for.
        prefill_ms, tail_ms, end_to_end_ms: Kind (`KINDS`) → median over its passes.
        tail_vs_raw: Kind → geometric mean over repeats of its tail / the raw tail.
        overlap: 1 − geometric mean over repeats of pd tail / after tail.
        passes: Every pass in run order: kind, repeat, prefill_ms, tail_ms.
        prefiller, decoder: The p2p tier's counters (`P2PTier.stats`) of each side, taken
            once the tier closed (every served chunk counted).
    """

    prefill_ms_per_chunk: float
    prefill_ms: dict
    tail_ms: dict
    end_to_end_ms: dict
    tail_vs_raw: dict
    overlap: float
    passes: list
    prefiller: dict
    decoder: dict


def _prefiller(pipe, count: int, chunk: int, ms_per_chunk: float) -> None:
    """Prefilling process body: a manager with `2 × count` host slots and an attached p2p
    tier, plus the raw TCP loop over the last pass's slots. Sends (p2p identity, raw port),
    then answers each (batch, kv_id or None, pulls to wait for) with a prefill's (start,
    last stored) monotonic seconds (or the exception it raised), "close" with the tier's
    counters once closed; None stops it."""
    from kvhal.engine.manager import Manager
    from kvhal.host.policy import LRUPolicy
    from kvhal.host.slots import SlotTable
    from kvhal.tiers.p2p import P2PTier
    region = np.empty(2 * count * chunk, dtype=np.uint8)
    data = memoryview(region)
    tier = P2PTier({"auth_key": AUTH_KEY, "max_inflight": 64}, data, NAMESPACE)
    manager = Manager(SlotTable(2 * count, LRUPolicy(2 * count)), slot_bytes=chunk,
                      chunk_nbytes=chunk, tiers=[tier], emit_events=False)
    offsets = [0] * count
    stored = payload(count, chunk)
    pipe.send((tier.identity, serve_raw_tcp(data, offsets, chunk)))
    try:
        while (order := pipe.recv()) is not None:
            if order == "close":
                manager.close()
                pipe.send(dict(tier.stats()))
                continue
            try:
                pipe.send(_prefill(manager, tier, region, stored, offsets,
                                   ms_per_chunk / 1e3, *order))
            except Exception as exc:  # noqa: BLE001 - the decoder reports it
                pipe.send(RuntimeError(f"prefill failed: {exc!r}"))
    finally:
        manager.close()


def _prefill(manager, tier, region: np.ndarray, stored: np.ndarray, offsets: list[int],
             pace_s: float, batch: int, kv_id: str | None, pulls: int) -> tuple[float, float]:
    """One simulated chunked prefill of batch `batch` (module docstring), parked under
    `kv_id` unless None, started once `pulls` fetches wait here. Sets `offsets[i]` to chunk
    i's slot offset. Returns (start, last chunk stored) in monotonic seconds.

    Raises:
        RuntimeError: the pulls did not come within `PULLS_WAIT_S`, or a chunk found no
            free host slot.
    """
    chunk = len(stored) // len(offsets)
    context = None
    if kv_id is not None:
        context = f"prefill-{batch}"
        manager.open_request(context, {"remote_decoder": {"kv_request_id": kv_id}})
    try:
        deadline = time.monotonic() + PULLS_WAIT_S
        while tier.stats()["fetches_waiting"] < pulls:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{pulls} pulls of the decode leg did not reach the "
                                   f"prefiller within {PULLS_WAIT_S:.0f} s")
            time.sleep(0.001)
        start = time.monotonic()
        for i in range(len(offsets)):
            time.sleep(max(0.0, start + (i + 1) * pace_s - time.monotonic()))
            plan = manager.prepare_store([chunk_key(i, batch)], context)
            if plan is None or len(plan.slots) != 1:
                if plan is not None:
                    manager.complete_store(plan.job_id, 0)  # an open job defers the seal
                raise RuntimeError(f"chunk {i} of batch {batch}: no free host slot")
            offsets[i] = int(plan.slots[0]) * chunk
            region[offsets[i]:offsets[i] + chunk] = stored[i * chunk:(i + 1) * chunk]
            manager.complete_store(plan.job_id)
        return start, time.monotonic()
    finally:  # sealed even when failed: the decoder's waiting pulls are refused at once
        manager.close_request(context)
        manager.poll()


class _Decoder:
    """The measuring process's side: a p2p tier with its own host region, and the raw loop's
    `concurrency` connections, made once (the tier pools its connections too)."""

    def __init__(self, pipe, identity: str, raw_port: int, count: int, chunk: int,
                 concurrency: int):
        from kvhal.tiers.p2p import P2PTier
        self.pipe, self.count, self.chunk, self.concurrency = pipe, count, chunk, concurrency
        self.out = np.zeros(count * chunk, dtype=np.uint8)
        view = memoryview(self.out)
        self.raw = RawTcp(raw_port, view, chunk)
        self._closing = contextlib.ExitStack()
        self.raw_states = self._closing.enter_context(connected(self.raw, concurrency))
        self.tier = P2PTier({"auth_key": AUTH_KEY, "num_threads": concurrency,
                             "timeout_s": 60.0, "fetch_wait_s": FETCH_WAIT_S}, view, NAMESPACE)
        self._closing.callback(self.tier.close)
        host, port = identity.rsplit(":", 1)
        self.source = {"remote_host": host, "remote_port": int(port)}

    def close(self) -> None:
        """Close the tier (its jobs finished first) and the raw loop's connections."""
        self._closing.close()

    def run(self, kind: str, batch: int) -> tuple[float, float]:
        """One pass of `kind` storing batch `batch`: (prefill, tail) in seconds."""
        keys = [chunk_key(i, batch) for i in range(self.count)]
        kv_id, context = f"kvhal-bench-pd-{batch}", f"decode-{batch}"
        params = {"remote_prefiller": {"kv_request_id": kv_id} | self.source}
        self.out[:] = 0
        if kind == "pd":
            self.tier.open_request(context, params)
            submit_pulls(self.tier, keys, self.chunk, context)
            self.pipe.send((batch, kv_id, min(self.count, self.concurrency)))
            try:
                finish_pulls(self.tier, self.count)
                end = time.monotonic()
            finally:  # a failed prefill fails the pulls too: its own error is the one raised
                start, last = recv_answer(self.pipe, "prefill")
        else:
            self.pipe.send((batch, kv_id if kind == "after" else None, 0))
            start, last = recv_answer(self.pipe, "prefill")
            if kind == "after":
                self.tier.open_request(context, params)
                submit_pulls(self.tier, keys, self.chunk, context)
                finish_pulls(self.tier, self.count)
            else:
                run_threads(self.raw_states, self.count, self.raw)
            end = time.monotonic()
        self.tier.close_request(context)
        return last - start, end - last


def measure(chunk: int, count: int, concurrency: int, repeats: int, ms_per_chunk: float,
            bar=None) -> PDBenchResult:
    """Run the P/D row (module docstring): `repeats` passes of each kind of `count` chunks of
    `chunk` bytes at `ms_per_chunk` ms of simulated compute each.

    Raises:
        RuntimeError: a pull or a prefill failed, or pulled bytes differ from the stored ones.
    """
    reference = payload(count, chunk)
    passes: list[dict] = []
    with serving(_prefiller, count, chunk, ms_per_chunk) as (pipe, (identity, port), _):
        decoder = _Decoder(pipe, identity, port, count, chunk, concurrency)
        task = bar.add_task("bench p2p P/D", total=repeats) if bar else None
        try:
            for r in range(repeats):
                for kind in KINDS[r % 3:] + KINDS[:r % 3]:
                    prefill_s, tail_s = decoder.run(kind, len(passes))
                    if not np.array_equal(decoder.out, reference):
                        raise RuntimeError(f"P/D {kind} pass delivered wrong bytes")
                    passes.append({"kind": kind, "repeat": r, "prefill_ms": 1e3 * prefill_s,
                                   "tail_ms": 1e3 * tail_s})
                if bar:
                    bar.advance(task)
            pipe.send("close")
            prefiller = recv_answer(pipe, "close")
        finally:
            decoder.close()
    tails = {(p["repeat"], p["kind"]): p["tail_ms"] for p in passes}

    def median(kind: str, *fields: str) -> float:
        return statistics.median(sum(p[f] for f in fields) for p in passes if p["kind"] == kind)

    def per_repeat(kind: str, over: str) -> float:
        return statistics.geometric_mean(tails[r, kind] / tails[r, over] for r in range(repeats))
    return PDBenchResult(
        ms_per_chunk,
        {k: median(k, "prefill_ms") for k in KINDS}, {k: median(k, "tail_ms") for k in KINDS},
        {k: median(k, "prefill_ms", "tail_ms") for k in KINDS},
        {k: per_repeat(k, "raw") for k in KINDS}, 1 - per_repeat("pd", "after"), passes,
        prefiller, dict(decoder.tier.stats()))


def table_rows(result: PDBenchResult) -> list[list]:
    """The P/D table's rows: path, prefill ms, tail ms, end-to-end ms (medians), × the raw TCP
    loop's tail (geometric mean of per-repeat ratios)."""
    names = {"pd": "P/D, decode leg first (streams)", "after": "P/D, prefill leg first",
             "raw": "raw TCP loop after the prefill"}
    return [[names[k], round(result.prefill_ms[k], 1), round(result.tail_ms[k], 2),
             round(result.end_to_end_ms[k], 1), round(result.tail_vs_raw[k], 2)]
            for k in KINDS]
