"""One instance's KV-event stream into its `InstanceIndex`: vLLM's ZMQ wire format, with gaps,
restarts, malformed batches and silence handled (fleet routing).

Wire format (vLLM `distributed/kv_events.py`, `ZmqEventPublisher`): the publisher's PUB socket
sends multipart `[topic, seq, payload]`, `seq` an 8-byte big-endian counter from 0 per
publisher start, `payload` a msgpack `KVEventBatch` (msgspec, array-like `[ts, events,
data_parallel_rank]`; each event a map tagged by its class name). Its optional ROUTER replay
socket answers a request `[b"", start_seq]` (8 bytes big-endian) from a DEALER with
`[b"", topic, seq, payload]` for every buffered batch from `start_seq` on, then
`[b"", b"", seq=-1, b""]`. The structs below mirror vLLM's field names and order; fields a
newer vLLM adds are ignored.

What each fault does (each logged once per occurrence, naming the instance; the instance is
then routed by load alone until its events resume, never a failed request):
- a gap in `seq` (batches lost): with a replay endpoint, the missing batches are asked for
  and applied; without one, or when the replay fails (no answer in `replay_timeout_s`, or
  its buffer no longer reaches back), the instance's index is cleared;
- `seq` going back (the publisher restarted: a new process has an empty device cache), or a
  batch that does not decode (malformed): the index is cleared, the stream resumes after it;
  after a restart with a replay endpoint, the new publisher's batches before the first one
  received (sent before the SUB socket reconnected) are replayed first;
- an event that does not apply (wrong field types, unknown medium): skipped and counted;
- a silent stream (the router sent the instance a request that must have stored blocks, no
  batch came while it ran, and none for `silence_s` after its answer): `check_silence`
  clears the index;
- the instance found dead (`drop`, by the proxy's health poll): the index is cleared.
At startup with a replay endpoint, the feed replays from seq 0 (the publisher's buffer: what
the instance stored before the router started; vLLM keeps `buffer_steps` batches), and again
at its first batch if that replay failed. A batch the SUB socket delivers after the replay
already applied it (same seq, same `ts`) is skipped as a duplicate.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from .prefix_index import EventError, InstanceIndex

log = logging.getLogger("kvhal.proxy.events")

#: Batches whose (seq, ts) a feed remembers to tell a duplicate from a restart.
RECENT_BATCHES = 4096
#: vLLM's end-of-replay marker (`ZmqEventPublisher.END_SEQ`).
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVCacheEvent(msgspec.Struct, omit_defaults=True, tag=True):
    """vLLM's event base class (its subclasses are tagged by class name)."""


class BlockStored(KVCacheEvent):
    """vLLM's `BlockStored`: blocks a medium gained (field names and order as vLLM's)."""

    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[Any]
    block_size: Any
    lora_id: Any
    medium: Any
    lora_name: Any = None
    extra_keys: Any = None
    group_idx: Any = None
    kv_cache_spec_kind: Any = None
    kv_cache_spec_sliding_window: Any = None
    locality: Any = None
    ownership: Any = None


class BlockRemoved(KVCacheEvent):
    """vLLM's `BlockRemoved`: blocks a medium lost."""

    block_hashes: list[Any]
    medium: Any
    group_idx: Any = None
    locality: Any = None
    ownership: Any = None


class AllBlocksCleared(KVCacheEvent):
    """vLLM's `AllBlocksCleared`: the instance's prefix cache was reset."""


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    """vLLM's `KVEventBatch`: one engine step's events."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


class ReplayFailed(RuntimeError):
    """The replay endpoint did not answer in time, or answered malformed frames."""


@dataclass(slots=True)
class FeedStats:
    """Counters of one stream, as `/router/stats` shows them."""

    batches: int = 0
    events: int = 0
    last_seq: int | None = None
    gaps: int = 0
    replays: int = 0
    replay_failures: int = 0
    restarts: int = 0
    duplicates: int = 0
    malformed: int = 0
    bad_events: int = 0
    cleared: int = 0
    silences: int = 0
    state: str = "waiting"      # waiting (no batch yet), live, silent, down


@dataclass(slots=True)
class EventFeed:
    """Subscribes to one instance's events and keeps `index` up to date (module docstring).

    Attributes:
        name: The instance, for log lines (its URL).
        endpoint: The publisher's PUB endpoint to connect to, e.g. "tcp://10.0.0.5:5557".
        replay: Its ROUTER replay endpoint, or None.
        index: The instance's index, changed only on the event loop running `run`.
        replay_timeout_s: Seconds a replay may take before it counts as failed.
        silence_s: Seconds without a batch after requests that must store blocks.
    """

    name: str
    endpoint: str
    replay: str | None
    index: InstanceIndex
    replay_timeout_s: float = 2.0
    silence_s: float = 10.0
    stats: FeedStats = field(default_factory=FeedStats)
    _expected: int | None = None
    _pending_since: float | None = None     # monotonic: first request owed a batch
    _recent: OrderedDict = field(default_factory=OrderedDict)     # seq -> ts applied

    def to_dict(self) -> dict:
        """The stream's endpoints and counters (JSON-ready)."""
        return {"endpoint": self.endpoint, "replay": self.replay} | asdict(self.stats)

    async def run(self, ctx: zmq.asyncio.Context) -> None:
        """Receive and apply batches until cancelled (never raises otherwise)."""
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.endpoint)
        try:
            if self.replay is not None:
                await self._catch_up(0, None, ctx, first=True)
            while True:
                frames = await sub.recv_multipart()
                await self.receive(frames, ctx)
        finally:
            sub.close(linger=0)

    async def receive(self, frames: list[bytes], ctx: zmq.asyncio.Context) -> None:
        """Handle one `[topic, seq, payload]` message from the PUB socket."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self._malformed(None, f"{len(frames)} frames, expected [topic, seq(8 bytes), "
                            f"payload]")
            return
        seq = int.from_bytes(frames[1], "big")
        try:
            batch = _DECODER.decode(frames[2])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._malformed(seq, str(exc))
            return
        expected = self._expected
        if expected is None:
            if self.replay is not None and seq > 0:
                await self._catch_up(0, seq, ctx, first=True)
        elif seq > expected:
            self.stats.gaps += 1
            if self.replay is None:
                self._clear(f"event batches {expected}..{seq - 1} lost (no replay endpoint)")
            else:
                await self._catch_up(expected, seq, ctx, first=False)
        elif seq < expected:
            if self._recent.get(seq) == batch.ts:
                self.stats.duplicates += 1
                return
            self.stats.restarts += 1
            self._clear(f"event seq went back from {expected - 1} to {seq} (publisher "
                        f"restarted, or batches out of order)")
            if self.replay is not None and seq > 0:
                # the new publisher's first batches went out before this SUB socket had
                # reconnected (ZMQ's slow joiner): a restarted instance announces there what
                # it found in its tiers
                self._expected = None
                await self._catch_up(0, seq, ctx, first=False)
        self._apply(seq, batch)

    def _apply(self, seq: int, batch: KVEventBatch) -> None:
        for event in batch.events:
            try:
                self.index.apply(event)
            except EventError as exc:
                self.stats.bad_events += 1
                log.warning("instance %s: event skipped in batch %d: %s", self.name, seq, exc)
        self._expected = seq + 1
        self._recent[seq] = batch.ts
        if len(self._recent) > RECENT_BATCHES:
            self._recent.popitem(last=False)
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        self.stats.last_seq = seq
        self._pending_since = None
        if self.stats.state != "live":
            if self.stats.state == "silent":
                log.info("instance %s: events resumed (seq %d)", self.name, seq)
            self.stats.state = "live"

    async def _catch_up(self, start: int, seq: int | None, ctx: zmq.asyncio.Context, *,
                        first: bool) -> None:
        """Replay batches start..seq-1 (seq None: all the publisher holds) and apply them;
        clear the index if that fails (`first`: nothing to clear, the index starts later)."""
        self.stats.replays += 1
        try:
            batches = await self._replay(start, ctx)
        except ReplayFailed as exc:
            self.stats.replay_failures += 1
            if first:
                log.warning("instance %s: replay of its earlier events failed (%s); the "
                            "index starts with the next batch", self.name, exc)
            else:
                self._clear(f"event batches {start}..{seq - 1} lost and their replay "
                            f"failed: {exc}")
            return
        end = seq if seq is not None else (batches[-1][0] + 1 if batches else start)
        missing = [s for s, _ in batches if start <= s < end]
        if missing[:1] != [start] and (seq is not None or missing):
            self.stats.replay_failures += 1
            if not first:
                self._clear(f"event batches {start}..{seq - 1} lost; the replay buffer "
                            f"starts at {missing[0] if missing else 'none of them'}")
        for s, batch in batches:
            if s < end and (self._expected is None or s >= self._expected):
                self._apply(s, batch)

    async def _replay(self, start: int, ctx: zmq.asyncio.Context
                      ) -> list[tuple[int, KVEventBatch]]:
        """The batches the replay endpoint holds from `start` on, in seq order.

        Raises:
            ReplayFailed: no complete answer within `replay_timeout_s`, or a malformed one.
        """
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        out = []
        try:
            sock.connect(self.replay)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self.replay_timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not await sock.poll(left * 1000):
                    raise ReplayFailed(f"no end of replay from {self.replay} within "
                                       f"{self.replay_timeout_s} s")
                frames = await sock.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    raise ReplayFailed(f"malformed replay answer ({len(frames)} frames)")
                if frames[2] == END_SEQ:
                    return sorted(out, key=lambda sb: sb[0])
                try:
                    out.append((int.from_bytes(frames[2], "big"), _DECODER.decode(frames[3])))
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    raise ReplayFailed(f"malformed replayed batch: {exc}") from None
        finally:
            sock.close(linger=0)

    def _malformed(self, seq: int | None, why: str) -> None:
        self.stats.malformed += 1
        self._clear(f"malformed event batch{'' if seq is None else f' (seq {seq})'}: {why}")
        if seq is not None:
            self._expected = seq + 1

    def _clear(self, why: str) -> None:
        self.stats.cleared += 1
        self.index.clear()
        log.warning("instance %s: %s; its index is cleared (routed by load until events "
                    "resume)", self.name, why)

    def expect_batch(self, batches_before: int) -> None:
        """The router sent the instance a request that must store blocks (a prompt longer
        than its cached prefix by a block) when `stats.batches` was `batches_before`, and it
        was answered: a batch is owed from now unless one came since it was sent (a long
        prefill on a loaded instance may publish its blocks long before its answer ends, then
        stay quiet for longer than `silence_s`)."""
        if self._pending_since is None and self.stats.batches == batches_before:
            self._pending_since = time.monotonic()

    def check_silence(self) -> None:
        """Clear the index if a batch was owed for `silence_s` and none came."""
        since = self._pending_since
        if since is None or time.monotonic() - since < self.silence_s:
            return
        self._pending_since = None
        self.stats.silences += 1
        self.stats.state = "silent"
        self._clear(f"no event batch for {self.silence_s:g} s after requests that store "
                    f"blocks (events disabled, or the publisher is stuck)")

    def drop(self, why: str) -> None:
        """The instance is down: forget what it held."""
        self.stats.state = "down"
        self._pending_since = None
        self._clear(f"instance unhealthy ({why})")
