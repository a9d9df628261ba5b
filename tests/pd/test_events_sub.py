"""The fleet router's event streams (`integrations/pd/events_sub.py`) over real ZMQ sockets:
vLLM's own `ZmqEventPublisher` (PUB + ROUTER replay) where it can produce the case, a raw
`fake_publisher` PUB socket for what vLLM never sends (malformed frames, seq going back), and
`FaultyPub` (drops one message of vLLM's publisher on the wire) / a `faulty_replay` ROUTER
that never answers for lost batches and failed replays."""
from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("msgspec", reason="the router needs the `proxy` extra")
kv_events = pytest.importorskip("vllm.distributed.kv_events",
                                reason="vLLM's publisher produces the test streams")

import msgspec
import zmq
import zmq.asyncio
from kvhal.integrations.pd.events_sub import EventFeed
from kvhal.integrations.pd.prefix_index import InstanceIndex, prefix_keys

from kvhal.procs import free_port

B = 16
TOKENS = list(range(500, 500 + 8 * B))
KEYS = prefix_keys(TOKENS)
OTHER = [3] * B


def block(i: int, tokens=TOKENS, name="d") -> kv_events.BlockStored:
    """vLLM's device event for block i of `tokens` (engine hash name+i, parent block i-1)."""
    return kv_events.BlockStored(
        block_hashes=[f"{name}{i}".encode()], parent_block_hash=f"{name}{i - 1}".encode()
        if i else None, token_ids=tokens[i * B:(i + 1) * B], block_size=B, lora_id=None,
        medium="GPU", lora_name=None)


def batch(*events) -> kv_events.KVEventBatch:
    return kv_events.KVEventBatch(ts=time.time(), events=list(events))


def held(feed: EventFeed) -> int:
    return feed.index.prefix(KEYS, "device")


async def until(predicate, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


class FaultyPub:
    """vLLM's PUB socket, dropping the messages whose seq is in `drop` (a lost batch: a fault
    vLLM's publisher does not produce on request); everything else forwarded."""

    def __init__(self, sock, drop: set[int]):
        self._sock, self._drop = sock, drop

    def send_multipart(self, frames, *a, **kw):
        if int.from_bytes(frames[1], "big") in self._drop:
            return None
        return self._sock.send_multipart(frames, *a, **kw)

    def __getattr__(self, name):
        return getattr(self._sock, name)


class Publisher:
    """vLLM's `ZmqEventPublisher` on free ports (`replay`: with its replay socket)."""

    def __init__(self, *, replay: bool, drop: set[int] = frozenset()):
        port, rport = free_port(), free_port()
        self.pub = kv_events.ZmqEventPublisher(
            0, endpoint=f"tcp://*:{port}",
            replay_endpoint=f"tcp://*:{rport}" if replay else None)
        self.pub._pub = FaultyPub(self.pub._pub, set(drop))
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.replay = f"tcp://127.0.0.1:{rport}" if replay else None
        self.seq = 0

    def publish(self, *events) -> int:
        """Publish one batch; its seq."""
        self.pub.publish(batch(*events))
        self.seq += 1
        return self.seq - 1


async def synced(pub, feed: EventFeed) -> None:
    """Publish empty batches until the feed received one (ZMQ's slow joiner)."""
    async def tick():
        while True:
            pub.publish()
            await asyncio.sleep(0.05)
    ticker = asyncio.create_task(tick())
    try:
        await until(lambda: feed.stats.batches > 0, "the subscription")
    finally:
        ticker.cancel()
    await until(lambda: feed.stats.last_seq == pub.seq - 1, "the last sync batch")


def run(scenario, pub, replay_endpoint="same", **feed_kw) -> EventFeed:
    """Run `scenario(pub, feed)` with a feed subscribed to `pub`; returns the feed."""
    replay = pub.replay if replay_endpoint == "same" else replay_endpoint
    feed = EventFeed("inst", pub.endpoint, replay, InstanceIndex(), **feed_kw)

    async def main():
        ctx = zmq.asyncio.Context()
        task = asyncio.create_task(feed.run(ctx))
        try:
            await scenario(pub, feed)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            ctx.term()
    try:
        asyncio.run(main())
    finally:
        if hasattr(pub, "pub"):
            pub.pub.shutdown()
    return feed


def test_a_late_subscriber_replays_what_the_publisher_stored_before_it():
    """Blocks published before the router subscribed are in its index through vLLM's replay
    socket. Fails without the startup replay (index empty)."""
    async def scenario(pub, feed):
        await synced(pub, feed)
        assert held(feed) == 3 * B
    pub = Publisher(replay=True)
    pub.publish(block(0), block(1), block(2))
    feed = run(scenario, pub)
    assert feed.stats.replays == 1 and feed.stats.cleared == 0


def test_a_lost_batch_is_replayed():
    """Fails when gaps are not detected (block 2 missing: index stops at 2 blocks, and block
    3's parent is unknown, so 2 blocks)."""
    async def scenario(pub, feed):
        await synced(pub, feed)
        pub.pub._pub._drop.add(pub.seq + 1)
        pub.publish(block(0), block(1))
        pub.publish(block(2))              # lost on the wire
        last = pub.publish(block(3))
        await until(lambda: feed.stats.last_seq == last, "the last batch")
        assert held(feed) == 4 * B
    feed = run(scenario, Publisher(replay=True))
    assert (feed.stats.gaps, feed.stats.cleared) == (1, 0)


def test_a_lost_batch_without_replay_clears_the_index():
    """The index after a gap holds only what came after it. Fails when gaps are ignored
    (blocks 0-1 would still be credited; a missed removal would keep a stale entry)."""
    async def scenario(pub, feed):
        await synced(pub, feed)
        pub.pub._pub._drop.add(pub.seq + 1)
        pub.publish(block(0), block(1))
        pub.publish(kv_events.BlockRemoved(block_hashes=[b"d1"], medium="GPU"))   # lost
        last = pub.publish(block(0, OTHER, "e"))
        await until(lambda: feed.stats.last_seq == last, "the last batch")
        assert held(feed) == 0
        assert feed.index.prefix(prefix_keys(OTHER), "device") == B
    feed = run(scenario, Publisher(replay=False))
    assert (feed.stats.gaps, feed.stats.cleared) == (1, 1)


def test_a_replay_that_never_answers_clears_the_index_in_time():
    """The replay endpoint is a ROUTER that never answers (`faulty_replay`): the feed gives
    up after `replay_timeout_s`, clears, and goes on with later batches."""
    ctx = zmq.Context.instance()
    faulty_replay = ctx.socket(zmq.ROUTER)
    rport = faulty_replay.bind_to_random_port("tcp://127.0.0.1")

    async def scenario(pub, feed):
        await synced(pub, feed)
        pub.pub._pub._drop.add(pub.seq + 1)
        pub.publish(block(0), block(1))
        pub.publish(block(2))              # lost
        pub.publish(block(3))              # the gap is seen here: replay, timeout, clear
        last = pub.publish(block(0, OTHER, "e"))
        await until(lambda: feed.stats.last_seq == last, "the last batch")
        assert held(feed) == 0 and feed.index.prefix(prefix_keys(OTHER), "device") == B
    try:
        feed = run(scenario, Publisher(replay=False),
                   replay_endpoint=f"tcp://127.0.0.1:{rport}", replay_timeout_s=0.3)
    finally:
        faulty_replay.close(linger=0)
    assert feed.stats.replay_failures >= 1
    assert feed.stats.cleared == 1


class RawPublisher:
    """`fake_publisher`: a raw PUB socket sending frames vLLM never sends (malformed, seq
    going back), with vLLM's encoding for the well-formed ones."""

    def __init__(self):
        self.sock = zmq.Context.instance().socket(zmq.PUB)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint, self.replay, self.seq = f"tcp://127.0.0.1:{port}", None, 0
        self._enc = msgspec.msgpack.Encoder()

    def publish(self, *events, seq: int | None = None, payload: bytes | None = None,
                frames: list | None = None) -> int:
        seq = self.seq if seq is None else seq
        self.seq = seq + 1
        if frames is None:
            frames = [b"", seq.to_bytes(8, "big"),
                      self._enc.encode(batch(*events)) if payload is None else payload]
        self.sock.send_multipart(frames)
        return seq


def test_malformed_batches_and_a_restarted_publisher_clear_the_index_and_go_on():
    """Fails when a malformed batch raises out of the feed (the task dies: later batches are
    never applied) or when seq going back is taken as an old duplicate."""
    fake_publisher = RawPublisher()

    async def scenario(pub, feed):
        await synced(pub, feed)
        pub.publish(block(0), block(1))
        pub.publish(payload=b"\xc1 not msgpack")
        last = pub.publish(block(0, OTHER, "e"))
        await until(lambda: feed.stats.last_seq == last, "the batch after the bad one")
        assert (held(feed), feed.stats.malformed, feed.stats.cleared) == (0, 1, 1)
        pub.publish(frames=[b"only one frame"])
        await until(lambda: feed.stats.malformed == 2, "the frame-count check")
        pub.publish(block(0), block(1), block(2), seq=0)    # a new publisher process
        await until(lambda: held(feed) == 3 * B, "the restarted publisher's blocks")
        assert feed.index.prefix(prefix_keys(OTHER), "device") == 0
        assert feed.stats.restarts == 1
    try:
        run(scenario, fake_publisher)
    finally:
        fake_publisher.sock.close(linger=0)


def test_a_restarted_publishers_first_batches_lost_to_the_slow_joiner_are_replayed():
    """vLLM's publisher restarted on the same ports (a killed server started again): its first
    batch (what a restarted kvhal instance announces it found on disk) goes out before the
    SUB socket has reconnected and is lost (`FaultyPub` drops seq 0). The feed sees seq going
    back, clears, and must replay the new publisher's earlier batches. Fails without that
    replay (block 2's parent unknown: nothing credited; seen in `kvhal soak`'s reasoning)."""
    async def scenario(pub, feed):
        await synced(pub, feed)
        pub.publish(block(0, OTHER, "e"))
        for _ in range(100):                    # the old process's seq runs far ahead
            pub.publish(block(1, OTHER, "e"))
        await until(lambda: feed.stats.last_seq == pub.seq - 1, "the old process's batches")
        endpoint, replay = pub.pub._endpoint, pub.pub._replay_endpoint
        pub.pub.shutdown()
        deadline = time.monotonic() + 20.0
        while True:                             # until the old sockets released the ports
            try:
                pub.pub = kv_events.ZmqEventPublisher(0, endpoint=endpoint,
                                                      replay_endpoint=replay)
                break
            except zmq.ZMQError:
                assert time.monotonic() < deadline, "the old publisher kept its ports"
                await asyncio.sleep(0.1)
        pub.pub._pub = FaultyPub(pub.pub._pub, {0})
        pub.seq = 0
        pub.publish(block(0), block(1))         # the restarted instance's announcement: lost
        while feed.stats.restarts == 0:         # until the SUB has reconnected
            assert pub.seq < 400, "the SUB socket did not reconnect"
            pub.publish()
            await asyncio.sleep(0.05)
        last = pub.publish(block(2))
        await until(lambda: feed.stats.last_seq == last, "the new process's batch")
        assert held(feed) == 3 * B
        assert feed.index.prefix(prefix_keys(OTHER), "device") == 0
    feed = run(scenario, Publisher(replay=True))
    assert feed.stats.restarts == 1


def test_a_stream_silent_after_requests_that_store_blocks_clears_the_index():
    """Fails when `check_silence` ignores owed batches (index kept, state live), or counts
    a request whose batch came while it ran as owed (seen under load: a 2,700-token prefill
    published its blocks, then its instance computed for over `silence_s` without a batch,
    and the router cleared a live index)."""
    async def scenario(pub, feed):
        await synced(pub, feed)
        last = pub.publish(block(0), block(1))
        await until(lambda: feed.stats.last_seq == last, "the blocks")
        feed.check_silence()
        assert held(feed) == 2 * B              # nothing owed: quiet is fine
        feed.expect_batch(feed.stats.batches - 1)     # a batch came while it ran
        await asyncio.sleep(0.3)
        feed.check_silence()
        assert (held(feed), feed.stats.state) == (2 * B, "live")
        feed.expect_batch(feed.stats.batches)   # none came while it ran
        feed.check_silence()
        assert held(feed) == 2 * B              # owed, but not for silence_s yet
        await asyncio.sleep(0.3)
        feed.check_silence()
        assert (held(feed), feed.stats.state, feed.stats.silences) == (0, "silent", 1)
        last = pub.publish(block(0), block(1))
        await until(lambda: feed.stats.state == "live", "events resuming")
        assert held(feed) == 2 * B
    run(scenario, Publisher(replay=False), silence_s=0.2)


def test_an_event_with_unhashable_fields_is_skipped_and_the_stream_goes_on():
    """vLLM's own `BlockStored` encodes whatever its fields hold; a parent hash or token ids
    that are msgpack arrays/maps decode as lists/dicts (unhashable). Fails when such an
    event raises out of the feed (its task dies: later batches are never applied) or
    leaves part of its chain in the index."""
    fake_publisher = RawPublisher()
    bad = [
        kv_events.BlockStored(block_hashes=[b"x0"], parent_block_hash=[1, 2],
                              token_ids=TOKENS[:B], block_size=B, lora_id=None,
                              medium="GPU", lora_name=None),
        kv_events.BlockStored(block_hashes=[b"y0", b"y1"], parent_block_hash=None,
                              token_ids=TOKENS[:B] + [[1]] * B, block_size=B, lora_id=None,
                              medium="GPU", lora_name=None),
        kv_events.BlockRemoved(block_hashes=[b"d0"], medium=["GPU"]),
    ]

    async def scenario(pub, feed):
        await synced(pub, feed)
        pub.publish(*bad)
        last = pub.publish(block(0), block(1))
        await until(lambda: feed.stats.last_seq == last, "the batch after the bad events")
        assert (held(feed), feed.stats.bad_events) == (2 * B, 3)
        assert feed.index.prefix(KEYS, "device") == 2 * B and len(feed.index.blocks) == 2
    try:
        run(scenario, fake_publisher)
    finally:
        fake_publisher.sock.close(linger=0)
