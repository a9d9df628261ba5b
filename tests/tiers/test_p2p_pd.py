"""P/D disaggregation over the p2p tier, at the tier level, with real processes and sockets.

A prefiller runs in its own process (`p2p_pd_peer.py`: a real engine manager with the p2p tier
attached to its host tier); the decoder is an engine manager in this process (or a second
process where it gets killed). Legs carry vLLM's `kv_transfer_params` (`remote_decoder`,
`remote_prefiller`), handed to the tier by `Manager.open_request`. Every fault ends within its
deadline with nothing leaked: the prefiller's pins (`parked_held`, `reading_slots`), records,
connections and threads; the decoder's slots and threads.
"""
from __future__ import annotations

import json
import logging
import threading
import time

import numpy as np
import pytest

from kvhal.engine.manager import Manager
from kvhal.host.policy import LRUPolicy
from kvhal.host.slots import SlotTable
from kvhal.tier import JobKind, Lookup
from kvhal.tiers.p2p import P2PTier

from .helpers import NAMESPACE, chunk_key, host_region, payload, wait_for
from .p2p_helpers import PeerProcess, config, fixed_port
from .p2p_pd_peer import SLOT

DECODER_SLOTS = 16
INDEX = {chunk_key(NAMESPACE, i): i for i in range(64)}
#: The decoder's wait for chunks not stored yet: far longer than any fail-fast bound below.
FETCH_WAIT_S = 30.0
#: How late a prefill leg is heard of after its decoder's fetches reached the prefiller: more
#: than the 5 s an unheard-of id once waited (`arrival_timeout_s`'s old default), with 2 s to
#: spare for a loaded machine's late wake-ups.
LATE_LEG_S = 7.0


class Prefiller(PeerProcess):
    """`p2p_pd_peer.py` in a separate process (commands: see its docstring)."""

    MODULE = "tests.tiers.p2p_pd_peer"

    def __init__(self, cfg: dict):  # noqa: super().__init__ would start the other peer
        self._spawn(cfg)

    def leg(self, ctx: str, kv_id: str) -> bool:
        """Open a prefill leg `ctx` parking under `kv_id`."""
        return json.loads(self.command(
            f"open {ctx} " + json.dumps({"remote_decoder": {"kv_request_id": kv_id}})))

    def store(self, ctx: str, first: int, count: int) -> int:
        return int(self.command(f"store {ctx} {first} {count}"))

    def close_leg(self, ctx: str) -> None:
        assert self.command(f"close {ctx}") == "ok"


def decode_params(prefiller, kv_id: str) -> dict:
    host, port = prefiller.address
    return {"remote_prefiller": {"kv_request_id": kv_id, "remote_host": host,
                                 "remote_port": port}}


class Decoder:
    """An engine manager with a p2p tier (no peers: decode legs need no directory)."""

    def __init__(self, **extra):
        self.host, self.array = host_region(SLOT * DECODER_SLOTS)
        self.tier = P2PTier(config(fetch_wait_s=FETCH_WAIT_S) | extra, self.host, NAMESPACE)
        self.manager = Manager(SlotTable(DECODER_SLOTS, LRUPolicy(DECODER_SLOTS)),
                               slot_bytes=SLOT, chunk_nbytes=SLOT, tiers=[self.tier],
                               emit_events=False)
        self.landed: dict[int, tuple[bool, str | None, float]] = {}

    def pull(self, ctx: str, params: dict, first: int, count: int) -> None:
        """Open the decode leg and look its chunks up (their promotions start)."""
        self.manager.open_request(ctx, params)
        self.manager.lookup([chunk_key(NAMESPACE, i) for i in range(first, first + count)],
                            request_id=ctx)

    def collect(self, count: int, timeout_s: float = 20.0) -> dict:
        """Wait until `count` pulls ended; chunk → (ok, error, monotonic time seen)."""
        def ended():
            for result in self.manager.poll():
                if result.kind is JobKind.LOAD:
                    self.landed[INDEX[result.key]] = (result.ok, result.error,
                                                      time.monotonic())
            return len(self.landed) >= count
        wait_for(ended, timeout_s, "the decoder's pulls")
        return self.landed

    def store(self, ctx: str, first: int, count: int) -> list:
        """Store chunks first.. for `ctx` (bytes `payload(i, SLOT)`) and wait for the p2p
        tier's store jobs; their results, in chunk order."""
        keys = [chunk_key(NAMESPACE, i) for i in range(first, first + count)]
        plan = self.manager.prepare_store(keys, request_id=ctx)
        for index, slot in zip(plan.indices.tolist(), plan.slots.tolist()):
            self.array[slot * SLOT:(slot + 1) * SLOT] = payload(first + index, SLOT)
        self.manager.complete_store(plan.job_id)
        stored = {}

        def ended():
            stored.update((INDEX[r.key], r) for r in self.manager.poll()
                          if r.kind is JobKind.STORE)
            return len(stored) >= count
        wait_for(ended, 10, "the p2p tier's stores")
        return [stored[i] for i in range(first, first + count)]

    def chunk_bytes(self, i: int) -> np.ndarray:
        slot = self.manager.slots.index[chunk_key(NAMESPACE, i)]
        return self.array[slot * SLOT:(slot + 1) * SLOT]

    def close(self) -> None:
        self.manager.close()


@pytest.fixture
def prefiller():
    procs = []

    def start(**extra):
        procs.append(Prefiller(config(**extra)))
        return procs[-1]
    yield start
    for proc in procs:
        assert proc.close() in (0, -9)


@pytest.fixture
def decoder():
    decoders = []
    threads = threading.active_count()

    def start(**extra):
        decoders.append(Decoder(**extra))
        return decoders[-1]
    yield start
    for d in decoders:
        d.close()
        assert d.manager.stats()["reading_slots"] == 0
    wait_for(lambda: threading.active_count() <= threads, 10, "the decoder's threads")


def released(prefiller) -> bool:
    """Nothing parked or pinned on the prefiller (a decoder's pooled connections may stay)."""
    stats = prefiller.stats()
    return (stats["parked_ids"], stats["parked_held"], stats["reading_slots"]) == (0, 0, 0)


def test_prefiller_first_decoder_gets_every_chunk_byte_exact_and_pins_end(prefiller, decoder):
    """Fails when parked chunks are not held and served (e.g. with `Parking.park` holding
    nothing) or not released after the decoder's `done`."""
    p, d = prefiller(), decoder()
    assert p.leg("p1", "pd-1")
    assert p.store("p1", 0, 4) == 4
    p.close_leg("p1")
    assert p.stats()["parked_held"] == 4 and p.stats()["reading_slots"] == 4

    d.pull("d1", decode_params(p, "pd-1"), 0, 4)
    landed = d.collect(4)

    assert all(ok for ok, _, _ in landed.values()), landed
    for i in range(4):
        np.testing.assert_array_equal(d.chunk_bytes(i), payload(i, SLOT))
    d.manager.close_request("d1")
    wait_for(lambda: released(p), 10, "the prefiller's release")
    wait_for(lambda: p.stats().get("chunks_served") == 4, 10, "4 chunks served")


def test_decoder_first_streams_chunks_as_they_land_and_a_missing_one_fails_fast(
        prefiller, decoder):
    """The decode leg arrives first; each chunk reaches it as the prefiller stores it (chunk
    0 lands before chunk 2 is stored), and a chunk the prefill never stores fails as soon as
    the prefill ends, not after `fetch_wait_s`. Fails when a fetch does not wait for its
    chunk (e.g. `Parking.wait` answering "not stored" while the record is open), or when the
    seal does not refuse a chunk the record lacks (e.g. with the `record.sealed` answer
    removed from `Parking.wait`, chunk 3 waits 30 s)."""
    p, d = prefiller(arrival_timeout_s=20.0), decoder()
    d.pull("d1", decode_params(p, "pd-2"), 0, 4)      # chunk 3 will never be stored
    time.sleep(0.3)   # the fetches are waiting for a leg that has not arrived
    assert d.manager.poll() == []
    assert p.leg("p1", "pd-2")
    assert p.store("p1", 0, 1) == 1
    d.collect(1)
    first_seen = time.monotonic()
    assert p.store("p1", 1, 2) == 2
    assert p.store("p1", 5, 1) == 1     # parked, never fetched: the record stays open
    d.collect(3)
    closed = time.monotonic()
    p.close_leg("p1")
    landed = d.collect(4)

    assert [landed[i][0] for i in range(4)] == [True, True, True, False]
    assert landed[0][2] <= first_seen < landed[2][2]
    assert landed[3][1].endswith("(chunk not stored by the prefill)"), landed[3][1]
    assert landed[3][2] - closed < 5.0 < FETCH_WAIT_S
    for i in range(3):
        np.testing.assert_array_equal(d.chunk_bytes(i), payload(i, SLOT))
    d.manager.close_request("d1")
    wait_for(lambda: released(p), 10, "the prefiller's release")


def test_pulls_waiting_on_the_prefiller_show_while_they_wait(prefiller, decoder):
    """The decoder's `pulls_waiting` gauge counts the fetches waiting on their prefiller (the
    leg has not arrived) and falls back to 0 once the chunks landed."""
    p, d = prefiller(arrival_timeout_s=20.0), decoder()
    waiting = d.tier.metrics["pulls_waiting"].labels()
    d.pull("d1", decode_params(p, "pd-w"), 0, 2)
    wait_for(lambda: waiting.read() == 2, 10, "two fetches waiting on the prefiller")
    assert p.leg("p1", "pd-w")
    assert p.store("p1", 0, 2) == 2
    landed = d.collect(2)
    p.close_leg("p1")

    assert [landed[i][0] for i in range(2)] == [True, True]
    assert waiting.read() == 0
    d.manager.close_request("d1")


def test_concurrent_legs(prefiller, decoder):
    """Both legs at once (llm-d's order): every chunk arrives. Fails when a fetch of an id
    whose leg opens meanwhile is refused (e.g. `arrival_timeout_s` not waited)."""
    p, d = prefiller(), decoder()
    prefill = threading.Thread(target=lambda: (p.leg("p1", "pd-3"), p.store("p1", 0, 3),
                                               p.close_leg("p1")))
    prefill.start()
    d.pull("d1", decode_params(p, "pd-3"), 0, 3)
    landed = d.collect(3)
    prefill.join(30)

    assert all(ok for ok, _, _ in landed.values()), landed
    d.manager.close_request("d1")
    wait_for(lambda: released(p), 10, "the prefiller's release")


def test_prefill_leg_heard_of_late_still_serves_the_waiting_decoder(prefiller, decoder):
    """Decode-first on a loaded prefiller: its scheduler sees the prefill leg `LATE_LEG_S`
    after the decoder's fetches arrived. With the default config the fetches wait for the
    leg (up to the decoder's `fetch_wait_s`, as in vLLM's tier) and every chunk lands. Seen
    failing with the fix reverted (tiers/p2p/config.py as before it, `arrival_timeout_s`
    defaulting to 5 s): each fetch was refused "unknown kv_request_id" after 5.05 s, and the
    decoder's poll after `LATE_LEG_S` held the three failed loads."""
    p, d = prefiller(), decoder()
    d.pull("d1", decode_params(p, "pd-12"), 0, 3)
    wait_for(lambda: p.stats()["fetches_waiting"] == 3, 10, "the decoder's fetches")
    start = time.monotonic()
    time.sleep(LATE_LEG_S)
    assert d.manager.poll() == []                  # still waiting, nothing refused
    assert p.leg("p1", "pd-12") and p.store("p1", 0, 3) == 3
    p.close_leg("p1")
    landed = d.collect(3)

    assert all(ok for ok, _, _ in landed.values()), landed
    assert min(t for _, _, t in landed.values()) - start >= LATE_LEG_S
    for i in range(3):
        np.testing.assert_array_equal(d.chunk_bytes(i), payload(i, SLOT))
    d.manager.close_request("d1")
    wait_for(lambda: released(p), 10, "the prefiller's release")


def test_decoder_done_before_the_prefill_leg_the_late_leg_parks_nothing(prefiller, decoder):
    """The decoder waits its `fetch_wait_s` (0.5 s here) for a leg the prefiller has not
    heard of, gives up (recomputes) and says `done`; the leg comes after that. Its chunks are
    stored but none is parked or pinned (no 60 s wait for a reap), and a later fetch of the
    id is refused at once. Seen failing with the tombstone removed (`Parking.finish`
    returning when it finds no record): (parked_ids, parked_held, reading_slots) was
    (1, 3, 3) and `park_late` absent."""
    p = prefiller()
    d = decoder(fetch_wait_s=0.5)
    d.pull("d1", decode_params(p, "pd-13"), 0, 3)
    assert all("unknown kv_request_id" in e for _, e, _ in d.collect(3).values())
    d.manager.close_request("d1")
    d.close()                           # joins the pull thread that sends `done`

    assert p.leg("p1", "pd-13") and p.store("p1", 0, 3) == 3
    stats = p.stats()
    assert (stats["parked_ids"], stats["parked_held"], stats["reading_slots"],
            stats.get("park_late")) == (0, 0, 0, 1)
    again = decoder()
    start = time.monotonic()
    again.pull("d2", decode_params(p, "pd-13"), 0, 1)
    (ok, error, seen), = again.collect(1).values()
    assert not ok and error.endswith("(kv_request_id given up by its decoder)"), error
    assert seen - start < 5.0 < FETCH_WAIT_S
    p.close_leg("p1")


def test_decoder_never_fetches_the_id_is_reaped_then_refused_at_once(prefiller, decoder):
    """Fails when parked chunks are never reaped (pins held forever) or a reaped id makes its
    fetch wait (e.g. without the `_gone` record of reaped ids the fetch waits
    `arrival_timeout_s` = 20 s)."""
    p = prefiller(unbound_store_timeout_s=0.5, arrival_timeout_s=20.0)
    assert p.leg("p1", "pd-4") and p.store("p1", 0, 2) == 2
    p.close_leg("p1")
    wait_for(lambda: p.stats().get("park_reaped") == 1, 10, "the reap")
    assert released(p)
    assert p.leg("p2", "pd-4")             # reused after the reap: its chunks (resident
    p.store("p2", 0, 2)                    # still) are not parked
    p.close_leg("p2")
    assert p.stats()["parked_held"] == 0                     # refused, nothing parked

    d = decoder()
    start = time.monotonic()
    d.pull("d1", decode_params(p, "pd-4"), 0, 2)
    landed = d.collect(2)

    assert not any(ok for ok, _, _ in landed.values())
    assert all("reaped" in error for _, error, _ in landed.values())
    assert max(t for _, _, t in landed.values()) - start < 5.0
    # the refusal is remembered for the request: its next lookups miss at once
    assert d.tier.lookup_for(chunk_key(NAMESPACE, 0), "d1").value == "miss"


def test_unknown_id_waits_only_for_its_arrival_and_a_wrong_key_gets_nothing(
        prefiller, decoder):
    """An id nobody opened is refused after `arrival_timeout_s`, not `fetch_wait_s`; another
    tenant's id with the right key is refused, and with a wrong key nothing is served at all.
    Fails when unknown ids wait for the chunk's whole wait (e.g. `arrival` ignored in
    `Parking.wait`)."""
    p = prefiller(arrival_timeout_s=1.0)
    assert p.leg("p1", "tenant-a-secret") and p.store("p1", 0, 2) == 2
    d = decoder()
    start = time.monotonic()
    d.pull("d1", decode_params(p, "tenant-b-guess"), 0, 2)
    landed = d.collect(2)
    assert all("unknown kv_request_id" in e for _, e, _ in landed.values())
    assert max(t for _, _, t in landed.values()) - start < 1.0 + 4.0 < FETCH_WAIT_S

    stranger = decoder(auth_key="another-tenant-key-0123456789")
    stranger.pull("s1", decode_params(p, "tenant-a-secret"), 0, 2)
    landed = stranger.collect(2)
    assert not any(ok for ok, _, _ in landed.values())
    stats = p.stats()
    assert stranger.tier.stats().get("auth_failed", 0) >= 1   # the prefiller's MAC is wrong
    assert stats.get("chunks_served", 0) == 0
    assert stats["parked_held"] == 2          # the owner's chunks are still parked


def test_second_fetch_of_a_finished_id_is_refused_at_once(prefiller, decoder):
    """The first decoder fetched every parked chunk of the sealed leg: the pins go at once,
    without a `done`. Fails when a finished id is forgotten (the second fetch then waits
    `arrival_timeout_s` = 20 s), e.g. with `_complete` not recording it."""
    p = prefiller(arrival_timeout_s=20.0)
    assert p.leg("p1", "pd-6") and p.store("p1", 0, 2) == 2
    p.close_leg("p1")
    d = decoder()
    d.pull("d1", decode_params(p, "pd-6"), 0, 2)
    assert all(ok for ok, _, _ in d.collect(2).values())
    wait_for(lambda: released(p), 10, "the prefiller's release")

    again = decoder()
    start = time.monotonic()
    again.pull("d2", decode_params(p, "pd-6"), 0, 2)
    landed = again.collect(2)
    assert all("kv_request_id finished" in e for _, e, _ in landed.values())
    assert max(t for _, _, t in landed.values()) - start < 5.0


def test_id_reused_at_once_releases_the_old_leg(prefiller, decoder):
    """Fails when opening a live id again keeps the old leg's pins (`parked_held` 4)."""
    p = prefiller()
    assert p.leg("p1", "pd-7") and p.store("p1", 0, 2) == 2
    assert p.leg("p2", "pd-7") and p.store("p2", 2, 2) == 2
    p.close_leg("p1")
    p.close_leg("p2")
    stats = p.stats()
    assert (stats["parked_held"], stats["reading_slots"], stats["park_reused"]) == (2, 2, 1)
    d = decoder()
    d.pull("d1", decode_params(p, "pd-7"), 2, 2)
    assert all(ok for ok, _, _ in d.collect(2).values())
    d.manager.close_request("d1")
    wait_for(lambda: released(p), 10, "the prefiller's release")


def test_decoder_done_with_part_of_the_chunks_releases_the_rest(prefiller, decoder):
    """The decoder needs only chunk 0 (its prompt ends inside chunk 1); its `done` releases
    chunks 1-2 at once. Fails when `close_request` sends no `done` (pins stay until reaped)."""
    p = prefiller()
    assert p.leg("p1", "pd-8") and p.store("p1", 0, 3) == 3
    p.close_leg("p1")
    d = decoder()
    d.pull("d1", decode_params(p, "pd-8"), 0, 1)
    assert d.collect(1)[0][0]
    assert p.stats()["parked_held"] == 3
    d.manager.close_request("d1")
    wait_for(lambda: released(p), 10, "the prefiller's release")


def test_prefiller_host_tier_full_the_rest_fails_fast(prefiller, decoder):
    """The prefiller's host tier holds 4 chunks: chunks 4-5 are never stored, and the decoder
    hears so at the end of the prefill (once every parked chunk was fetched the id is done,
    which refuses them at once too). Fails when neither refuses them (30 s wait)."""
    p = prefiller(slots=4)
    assert p.leg("p1", "pd-9")
    assert p.store("p1", 0, 6) == 4
    d = decoder()
    d.pull("d1", decode_params(p, "pd-9"), 0, 6)
    d.collect(4)
    start = time.monotonic()
    p.close_leg("p1")
    landed = d.collect(6)
    assert [landed[i][0] for i in range(6)] == [True] * 4 + [False] * 2
    assert max(landed[i][2] for i in (4, 5)) - start < 5.0
    d.manager.close_request("d1")
    wait_for(lambda: released(p), 10, "the prefiller's release")


@pytest.mark.parametrize("when", ["before", "during"])
def test_prefiller_killed_the_decoder_fails_fast(prefiller, decoder, when):
    """SIGKILL before the pull (connection refused) or while the decoder waits for chunks not
    stored yet (connection reset): every pull fails within seconds, not `fetch_wait_s`, and
    the decoder's slots are freed (the fixture checks its pins and threads)."""
    p = prefiller()
    assert p.leg("p1", "pd-10") and p.store("p1", 0, 1) == 1
    d = decoder()
    if when == "before":
        p.kill()
        start = time.monotonic()
        d.pull("d1", decode_params(p, "pd-10"), 0, 3)
    else:
        d.pull("d1", decode_params(p, "pd-10"), 0, 3)
        d.collect(1)
        start = time.monotonic()
        p.kill()
    landed = d.collect(3)
    failed = sorted(i for i, (ok, _, _) in landed.items() if not ok)
    assert failed == ([0, 1, 2] if when == "before" else [1, 2])
    assert max(landed[i][2] for i in failed) - start < 5.0
    d.manager.close_request("d1")
    assert d.manager.stats()["promotion_slots"] == 0


def test_decoder_killed_mid_pull_the_prefiller_reaps_and_leaks_nothing(prefiller):
    """The decoder (its own process) waits for chunks and is SIGKILLed: the prefiller's served
    connections end, the record is reaped and every pin released, threads back to before.
    Fails when a server thread waiting in `Parking.wait` outlives its connection forever."""
    p = prefiller(unbound_store_timeout_s=1.0, arrival_timeout_s=20.0)
    threads = p.stats()["threads"]
    d = Prefiller(config(fetch_wait_s=FETCH_WAIT_S))          # a decoder process
    try:
        assert json.loads(d.command("open d1 " + json.dumps(decode_params(p, "pd-11"))))
        assert d.command("pull d1 0 3") == "ok"
        assert p.leg("p1", "pd-11") and p.store("p1", 0, 1) == 1
        wait_for(lambda: p.stats().get("chunks_served") == 1, 10, "the first chunk")
        d.kill()
    finally:
        d.close()
    wait_for(lambda: p.stats().get("park_reaped") == 1, 15, "the reap")
    wait_for(lambda: released(p) and p.stats()["connections"] == 0
             and p.stats()["threads"] <= threads, 15, "the prefiller's release")


@pytest.mark.parametrize("block,why", [
    ({}, "kv_transfer_params.remote_decoder.kv_request_id must be a string of 1..200 "
         "characters, got None"),
    ({"kv_request_id": 7}, "kv_transfer_params.remote_decoder.kv_request_id must be a "
                           "string of 1..200 characters, got 7"),
    (["pd-14"], "kv_transfer_params.remote_decoder must be an object with kv_request_id, got "
                "list ['pd-14']"),
], ids=["no-id", "int-id", "list"])
def test_malformed_remote_decoder_fails_the_legs_stores(decoder, block, why, caplog):
    """A prefill leg whose `remote_decoder` block has no usable id: vLLM's tier fails its
    stores (`orchestration` module docstring: `_parse_dest`, `submit_store`), and so does
    kvhal's, with one ERROR naming the request, the key and the value; the chunks stay in the
    host tier and nothing is parked. Seen failing with the block ignored as before
    (`open_request` answered False: not a leg, its stores ok) and, with the parse fixed, with
    `P2PTier.submit_store` not checking `park_error`: `[(True, None), (True, None)]`."""
    inst = decoder()
    with caplog.at_level(logging.ERROR, "kvhal.tiers.p2p.orchestration"):
        assert inst.manager.open_request("p1", {"remote_decoder": block})
    (record,) = caplog.records
    assert record.getMessage().startswith(f"request p1: {why}; ")

    results = inst.store("p1", 0, 2)

    assert [(r.ok, r.error) for r in results] == [(False, why)] * 2
    stats = inst.tier.stats()
    assert (stats["store_failed"], stats["parked_ids"], stats["parked_held"]) == (2, 0, 0)
    assert inst.manager.lookup([chunk_key(NAMESPACE, i) for i in range(2)]) == [Lookup.HIT] * 2
    inst.manager.close_request("p1")


@pytest.mark.parametrize("first_use", ["finished", "replaced"])
def test_a_late_done_of_a_reused_id_leaves_the_new_leg_parked(prefiller, decoder, first_use):
    """The orchestrator reuses an id at once, and the first decoder's `done` reaches the
    prefiller only after the second leg parked its chunks. That `done` names the generation
    the first decoder fetched from, older than the new leg's record, and releases nothing of
    it (`done_stale`): the second decoder gets every chunk, and its own `done` releases them.
    "finished": the first decoder fetched all of its sealed leg (that record ended);
    "replaced": it fetched chunk 0 of 2, and the second leg opened while the first was live.
    Seen failing with `Parking.finish` ignoring the generation (as before the fix): the late
    `done` released the second leg, (parked_held, reading_slots, done_stale) was (0, 0, None),
    and the second decoder's pulls were refused "kv_request_id finished"."""
    p = prefiller()
    assert p.leg("p1", "pd-15") and p.store("p1", 0, 2) == 2
    p.close_leg("p1")
    first = decoder()
    wanted = 2 if first_use == "finished" else 1
    first.pull("d1", decode_params(p, "pd-15"), 0, wanted)
    assert all(ok for ok, _, _ in first.collect(wanted).values())
    if first_use == "finished":
        wait_for(lambda: released(p), 10, "the end of the first leg's record")
    assert p.leg("p2", "pd-15") and p.store("p2", 2, 2) == 2      # the id reused at once
    p.close_leg("p2")
    first.manager.close_request("d1")
    first.close()                   # joins the pull thread: the prefiller answered its `done`

    stats = p.stats()
    assert (stats["parked_held"], stats["reading_slots"], stats.get("done_stale")) == (2, 2, 1)
    second = decoder()
    second.pull("d2", decode_params(p, "pd-15"), 2, 2)
    landed = second.collect(2)
    assert [(ok, error) for ok, error, _ in landed.values()] == [(True, None)] * 2
    for i in (2, 3):
        np.testing.assert_array_equal(second.chunk_bytes(i), payload(i, SLOT))
    second.manager.close_request("d2")
    wait_for(lambda: released(p), 10, "the prefiller's release")


def test_prefiller_engine_of_data_parallel_index_2_serves_on_port_plus_2(prefiller, decoder):
    """vLLM's p2p tier listens on its base `port` + the engine's data-parallel index, and an
    orchestrator names that port as `remote_port` (README, "P/D with kvhal proxy"). A
    prefiller engine of index 2 (passed as vLLM's connector passes it, through
    `build_tiers`) listens on base + 2, where a decode leg gets every chunk; nothing listens
    on the base port, so a leg naming it fails at once. Seen failing with the index not
    passed on (`build_tiers` ignoring `TierSpec.instance_keys`): the prefiller listened on
    the base port, `('127.0.0.1', base) == ('127.0.0.1', base + 2)`."""
    base = fixed_port(span=3)
    p = prefiller(port=base, data_parallel_index=2)
    assert p.address == ("127.0.0.1", base + 2)
    assert p.leg("p1", "pd-16") and p.store("p1", 0, 2) == 2
    p.close_leg("p1")
    d = decoder()

    d.pull("d1", decode_params(p, "pd-16"), 0, 2)
    landed = d.collect(2)
    wrong = decoder()
    wrong.pull("d2", {"remote_prefiller": {"kv_request_id": "pd-16", "remote_host": "127.0.0.1",
                                           "remote_port": base}}, 0, 1)
    (ok, error, _), = wrong.collect(1).values()

    assert [(ok, error) for ok, error, _ in landed.values()] == [(True, None)] * 2
    for i in range(2):
        np.testing.assert_array_equal(d.chunk_bytes(i), payload(i, SLOT))
    assert not ok and error == f"peer 127.0.0.1:{base}: cannot connect (ConnectionRefusedError)"
    d.manager.close_request("d1")
    wait_for(lambda: released(p), 10, "the prefiller's release")


def source_params(peer, kv_id: str) -> dict:
    host, port = peer.address
    return {"remote_kv_source": {"kv_request_id": kv_id, "remote_host": host,
                                 "remote_port": port}}


def settled(d: Decoder, ctx: str, keys: list) -> list:
    """`ctx`'s tier answers for `keys` once the named peer answered (no RETRY left)."""
    answers = []

    def done():
        answers[:] = [d.tier.lookup_for(k, ctx) for k in keys]
        return Lookup.RETRY not in answers
    wait_for(done, 10, "the named peer's answer")
    return answers


def test_remote_kv_source_claims_only_what_the_named_peer_holds(prefiller, decoder):
    """A load-balancing request names a peer whose host tier holds chunks 0-2 of its 5. Its
    first lookup claims none of them (UNDECIDED: the peer is being asked, vLLM asks again),
    the answers then settle on what the peer holds, and exactly those three are pulled, byte
    exact, with no failed load. Seen failing with `lookup_for` answering HIT unasked (as
    before the fix): the first lookup claimed all five, `[RETRY] * 5` (promotions started),
    and the pulls of chunks 3-4 failed "miss (not held)"."""
    p = prefiller()
    assert p.store("src", 0, 3) == 3
    d = decoder()
    keys = [chunk_key(NAMESPACE, i) for i in range(5)]
    assert d.manager.open_request("lb", source_params(p, "lb-1"))

    first = d.manager.lookup(keys, request_id="lb")
    answers = settled(d, "lb", keys)
    again = d.manager.lookup(keys, request_id="lb")
    landed = d.collect(3)

    assert first == [Lookup.UNDECIDED] * 5
    assert answers == [Lookup.HIT] * 3 + [Lookup.MISS] * 2
    assert again == [Lookup.RETRY] * 3 + [Lookup.MISS] * 2
    assert sorted((i, ok, error) for i, (ok, error, _) in landed.items()) == [
        (0, True, None), (1, True, None), (2, True, None)]
    for i in range(3):
        np.testing.assert_array_equal(d.chunk_bytes(i), payload(i, SLOT))
    stats = d.tier.stats()
    assert (stats["probed_keys"], stats.get("load_failed", 0)) == (5, 0)
    wait_for(lambda: (p.stats().get("chunks_served"), p.stats()["reading_slots"]) == (3, 0),
             10, "3 chunks served, nothing pinned (a probe pins nothing)")
    d.manager.close_request("lb")


def test_remote_kv_source_naming_a_dead_peer_misses_without_a_pull(prefiller, decoder):
    """The named peer was killed: the probe fails within `timeout_s` (2 s), every chunk is a
    MISS from then on and nothing is pulled. Seen failing with a failed probe leaving its keys
    RETRY (`Probes._drain` not settling them; the request would be asked about forever):
    "timed out after 10 s waiting for the named peer's answer"."""
    p = prefiller()
    p.kill()
    d = decoder()
    keys = [chunk_key(NAMESPACE, i) for i in range(3)]
    assert d.manager.open_request("lb", source_params(p, "lb-2"))
    start = time.monotonic()

    first = d.manager.lookup(keys, request_id="lb")
    answers = settled(d, "lb", keys)

    assert time.monotonic() - start < 2.0 + 3.0
    assert first == [Lookup.UNDECIDED] * 3
    assert answers == [Lookup.MISS] * 3
    assert d.manager.lookup(keys, request_id="lb") == [Lookup.MISS] * 3
    stats = d.tier.stats()
    assert (stats["probed_keys"], stats["probe_failed"], stats.get("load_failed", 0)) == (3, 3, 0)
    d.manager.close_request("lb")


def test_an_old_prefill_leg_ending_after_its_id_was_reopened_leaves_the_new_leg_open(
        prefiller, decoder):
    """The orchestrator reopens an id while its first prefill leg still runs (a retry): the
    old leg's later store parks nothing into the new leg's record (that store fails), and
    its end does not seal it, so the new leg parks all 4 chunks and the decoder gets them.
    Seen failing with `Parking.park` and `seal` ignoring the generation (as before): the old
    leg's late store parked into the new record and its end sealed it, so the new leg's
    stores were refused, (parked_held, park_reused, store_failed) `(1, 1, 4) == (4, 1, 1)`,
    and the decoder got chunk 2 only (the rest refused, "kv_request_id finished")."""
    p = prefiller()
    assert p.leg("p1", "pd-17") and p.store("p1", 0, 2) == 2
    assert p.leg("p2", "pd-17")                   # reopened while p1 still runs
    assert p.store("p1", 2, 1) == 1               # p1's late store: resident, not parked
    p.close_leg("p1")                             # p1 ends after p2 opened
    assert p.store("p2", 0, 4) == 1               # chunks 0-2 resident already, all parked
    p.close_leg("p2")
    stats = p.stats()
    assert (stats["parked_held"], stats["park_reused"], stats["store_failed"]) == (4, 1, 1)

    d = decoder()
    d.pull("d1", decode_params(p, "pd-17"), 0, 4)
    landed = d.collect(4)

    assert [(landed[i][0], landed[i][1]) for i in range(4)] == [(True, None)] * 4
    for i in range(4):
        np.testing.assert_array_equal(d.chunk_bytes(i), payload(i, SLOT))
    d.manager.close_request("d1")
    wait_for(lambda: released(p), 10, "the prefiller's release")
