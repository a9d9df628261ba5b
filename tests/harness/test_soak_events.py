"""`kvhal soak`'s check that events stay true (`integrations/harness/soak/events.py`), without
vLLM servers: recorded event batches fed to the router's real `EventFeed` (msgpack frames as
vLLM's publisher sends them), real fs chunk files written by the fs tier's own writer, and a
`ClaimLedger` checked against their states."""
from __future__ import annotations

import asyncio
import os
import time

import msgspec
import pytest
import zmq.asyncio
from kvhal.integrations.harness.soak.events import (
    BOUND_S,
    ClaimLedger,
    FsState,
    _ledger_index,
    external_hash,
    tier_of,
)
from kvhal.integrations.pd import events_sub
from kvhal.tiers.fs.fileio import Scratch, write_chunk
from kvhal.tiers.fs.format import chunk_path, namespace_dir

from kvhal.keys import ChunkKey

NAMESPACE = bytes(range(16))


def test_external_hash_is_what_vllm_publishes():
    kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    h = bytes(range(32))
    assert external_hash(h) == int.from_bytes(h[-8:], "big")
    assert external_hash(h) == (int.from_bytes(h, "big") & ((1 << 64) - 1))
    if kv_cache_utils.envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES:
        assert external_hash(h) == kv_cache_utils.maybe_convert_block_hash(h)
    assert external_hash(external_hash(h)) == external_hash(h)


@pytest.mark.parametrize("medium, locality, tier", [
    ("GPU", None, "device"), (None, None, "device"), ("CPU", None, "host"),
    ("STORAGE", "LOCAL", "fs"), ("STORAGE", "REMOTE", "obj"), ("CPU", "REMOTE", "pool")])
def test_media_map_to_the_soak_tiers(medium, locality, tier):
    assert tier_of(medium, locality) == tier


def test_a_claim_retracted_while_its_chunk_was_there_is_not_stale():
    ledger = ClaimLedger()
    ledger.stored("a", "fs", [1, 2], 0.5)
    ledger.check({"fs": {1: "ok", 2: "ok"}}, 1.0)
    ledger.removed("a", "fs", [1], 1.5)
    t = ledger.report(2.0)["tiers"]["fs"]
    assert t["claims"] == 2 and t["retracted"] == 1 and t["stale_retracted"] == 0


def test_staleness_runs_from_the_last_good_check_or_the_fault_that_hit_it():
    """Fails when staleness is counted from the claim, from the first bad check only, or when
    a hint outside (last good, first bad] is used."""
    ledger = ClaimLedger()
    ledger.stored("a", "fs", [1, 2], 0.0)
    ledger.check({"fs": {1: "ok", 2: "ok"}}, 3.0)
    ledger.hint("fs", 4.5, [b"\0" * 24 + (2).to_bytes(8, "big")])     # chunk 2's file
    ledger.hint("fs", 1.0, [1])                                         # before the good check
    ledger.check({"fs": {}}, 6.0)
    ledger.removed("a", "fs", [1, 2], 7.0)
    t = ledger.report(8.0)["tiers"]["fs"]
    assert t["became_unloadable"] == {"missing": 2, "damaged": 0, "unreachable": 0}
    assert t["stale_retracted"] == 2
    assert t["max_stale_s"] == 4.0          # chunk 1: from the good check at 3
    assert t["max_stale_lo_s"] == 1.0       # from the bad check at 6
    assert t["violations"] == 0
    ledger2 = ClaimLedger()
    ledger2.stored("a", "fs", [2], 0.0)
    ledger2.check({"fs": {2: "ok"}}, 3.0)
    ledger2.hint("fs", 4.5, [2])
    ledger2.check({"fs": {}}, 6.0)
    ledger2.removed("a", "fs", [2], 7.0)
    assert ledger2.report(8.0)["tiers"]["fs"]["max_stale_s"] == 2.5


def test_a_missing_chunk_claimed_past_the_bound_is_a_violation_a_damaged_one_is_reported():
    """Fails when claims standing at the end are dropped from the report, or when damaged
    files (a known limitation: found at load) count as violations."""
    ledger = ClaimLedger()
    ledger.stored("a", "obj", [1, 2], 0.0)
    ledger.stored("b", "fs", [3], 0.0)
    ledger.check({"obj": {1: "ok", 2: "ok"}, "fs": {3: "ok"}}, 1.0)
    ledger.check({"obj": {}, "fs": {3: "damaged"}}, 2.0)
    late = 2.0 + BOUND_S["obj"] + 1.0
    ledger.removed("a", "obj", [1], late)
    report = ledger.report(late + 100.0)
    obj, fs = report["tiers"]["obj"], report["tiers"]["fs"]
    assert obj["violations"] == 2                       # 1 retracted late, 2 never
    assert obj["never_retracted"] == {"missing": 1, "damaged": 0, "unreachable": 0}
    assert obj["max_never_retracted_s"] == late + 100.0 - 1.0
    assert fs["never_retracted"] == {"missing": 0, "damaged": 1, "unreachable": 0} and fs["violations"] == 0


def test_a_claim_past_the_bound_while_its_server_was_stopped_is_reported_apart():
    """A SIGSTOPped server publishes nothing (a router's health poll drops it): its claims
    past the bound are counted apart, even when the stop is told after the retraction (the
    fault thread records a stop at its end). Fails when they count as violations, or when
    another server's stop excuses them."""
    ledger = ClaimLedger()
    ledger.stored("a", "fs", [1], 0.0)
    ledger.stored("b", "fs", [1], 0.0)
    ledger.check({"fs": {1: "ok"}}, 1.0)
    ledger.check({"fs": {}}, 2.0)
    late = 2.0 + BOUND_S["fs"] + 5.0
    ledger.removed("a", "fs", [1], late)
    ledger.removed("b", "fs", [1], late)
    ledger.stopped("a", 1.5, late - 1.0)
    fs = ledger.report(late + 1.0)["tiers"]["fs"]
    assert fs["violations"] == 1 and fs["violation_examples"][0]["server"] == "b"
    assert fs["past_bound_while_stopped"] == 1


def test_claims_on_a_store_that_refuses_connections_are_unreachable_not_violations():
    """Fails when a down S3 server's claims are left unchecked (never reported) or counted
    as missing chunks (violations)."""
    from kvhal.integrations.harness.soak.events import UNREACHABLE

    ledger = ClaimLedger()
    ledger.stored("a", "obj", [1], 0.0)
    ledger.check({"obj": {1: "ok"}}, 1.0)
    ledger.check({"obj": UNREACHABLE}, 2.0)
    obj = ledger.report(100.0)["tiers"]["obj"]
    assert obj["never_retracted"]["unreachable"] == 1 and obj["violations"] == 0
    assert obj["max_never_retracted_s"] == 99.0


def test_a_claim_newer_than_the_snapshot_is_not_judged_by_it():
    """Fails when a snapshot taken before a chunk was stored marks its claim missing."""
    ledger = ClaimLedger()
    ledger.stored("a", "fs", [1], 5.0)
    ledger.check({"fs": {}}, 4.0, at_s=6.0)
    ledger.removed("a", "fs", [1], 30.0)
    assert ledger.report(31.0)["tiers"]["fs"]["stale_retracted"] == 0


def test_a_chunk_loadable_again_ends_its_staleness():
    ledger = ClaimLedger()
    ledger.stored("a", "fs", [1], 0.0)
    ledger.check({"fs": {}}, 1.0)
    ledger.check({"fs": {1: "ok"}}, 2.0)        # the other server stored it again
    ledger.removed("a", "fs", [1], 40.0)
    t = ledger.report(41.0)["tiers"]["fs"]
    assert t["stale_retracted"] == 0 and t["violations"] == 0


def test_unchecked_tiers_are_counted_only():
    ledger = ClaimLedger()
    ledger.stored("a", "host", [1, 2], 0.0)
    ledger.stored("a", "pool", [3], 0.0)
    ledger.check({"fs": {}}, 1.0)
    report = ledger.report(2.0)
    assert report["unchecked_claims"] == {"host": 2, "pool": 1} and report["tiers"] == {}


# -- real chunk files ------------------------------------------------------------------------
def _write(root, i: int) -> tuple[str, int]:
    ns_dir = namespace_dir(str(root), NAMESPACE)
    key = ChunkKey(NAMESPACE, 0, bytes([i]) * 32)
    os.makedirs(os.path.dirname(chunk_path(ns_dir, key)), exist_ok=True)
    write_chunk(os, ns_dir, key, memoryview(bytes(range(256)) * 40), False, Scratch(), False)
    return chunk_path(ns_dir, key), external_hash(key.block_hash)


def test_fs_state_tells_good_damaged_and_missing_files(tmp_path):
    """Fails when a file rewritten in place (same size) keeps its cached verdict, or when a
    file is judged by its name alone."""
    files = [_write(tmp_path, i) for i in (1, 2, 3, 4)]
    state = FsState(str(tmp_path))
    assert state.snapshot() == {h: "ok" for _, h in files}
    (p1, h1), (p2, h2), (p3, h3), _ = files
    with open(p1, "r+b") as f:
        f.truncate(os.path.getsize(p1) // 2)
    size = os.path.getsize(p2)
    with open(p2, "r+b") as f:
        f.seek(size // 2)
        f.write(b"\xff" * 16)
    os.utime(p2, ns=(time.time_ns(), time.time_ns() + 10**9))   # a later write: new mtime
    os.unlink(p3)
    snap = state.snapshot()
    assert snap[h1] == "damaged" and snap[h2] == "damaged" and h3 not in snap
    assert len(snap) == 3


# -- recorded event batches through the router's feed ----------------------------------------
def _frames(seq: int, *events) -> list[bytes]:
    batch = events_sub.KVEventBatch(ts=time.time() + seq, events=list(events))
    return [b"kv", seq.to_bytes(8, "big"), msgspec.msgpack.encode(batch)]


def _stored(h: int, medium: str, locality: str | None) -> events_sub.BlockStored:
    return events_sub.BlockStored(block_hashes=[h], parent_block_hash=None,
                                  token_ids=list(range(128)), block_size=128, lora_id=None,
                                  medium=medium, locality=locality)


def test_recorded_batches_through_the_feed_make_claims_that_the_files_check(tmp_path):
    """The whole path without vLLM: the router's `EventFeed` decodes recorded batches into the
    ledger; a deleted file's claim is stale until its `BlockRemoved`; a publisher restart
    (seq back to 0) ends every claim, and the restarted server's re-announcement of the file
    it found credits it again. Fails when `LedgerIndex` does not record, or a restart is not
    a clear."""
    (path, h), (_, h2) = _write(tmp_path, 1), _write(tmp_path, 2)
    clock = [0.0]
    ledger = ClaimLedger()
    feed = events_sub.EventFeed("a", "tcp://127.0.0.1:1", None,
                                _ledger_index(ledger, "a", lambda: clock[0]))
    fs = FsState(str(tmp_path))

    async def main():
        ctx = zmq.asyncio.Context()
        try:
            await feed.receive(_frames(0, _stored(h, "STORAGE", "LOCAL"),
                                       _stored(h2, "STORAGE", "LOCAL"),
                                       _stored(7, "GPU", None)), ctx)
            ledger.check({"fs": fs.snapshot()}, 1.0)
            os.unlink(path)
            clock[0] = 3.0
            ledger.check({"fs": fs.snapshot()}, 2.0)
            await feed.receive(_frames(1, events_sub.BlockRemoved(
                block_hashes=[h], medium="STORAGE", locality="LOCAL")), ctx)
            clock[0] = 10.0
            await feed.receive(_frames(0, _stored(h2, "STORAGE", "LOCAL")), ctx)   # restart
        finally:
            ctx.term()

    asyncio.run(main())
    assert feed.index.counts()["disk"] == 1          # the router's own index followed
    report = ledger.report(11.0)
    fs_tally = report["tiers"]["fs"]
    assert fs_tally["stale_retracted"] == 1 and fs_tally["max_stale_s"] == 2.0
    assert fs_tally["claims"] == 3 and fs_tally["retracted"] == 2
    assert report["unchecked_claims"] == {"device": 1}
    assert [c["dropped"] for c in report["clears"]] == [{"fs": 1}]
    assert report["clears"][0]["recredited_60s"] == {"fs": 1}


# -- the watch over real ZMQ: vLLM's own publisher -------------------------------------------
def _until(predicate, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_the_watch_follows_vllms_publisher_and_the_faults_it_is_told_of(tmp_path, monkeypatch):
    """`EventWatch` as the soak runs it: vLLM's `ZmqEventPublisher` (PUB + replay) publishes
    fs claims; the watch's checks find a truncated file (named by a fault: its staleness runs
    from the fault) and a deleted one (stale until its `BlockRemoved`). Fails when the watch
    does not subscribe, does not check periodically, or ignores the faults it is told of."""
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    from types import SimpleNamespace

    from kvhal.integrations.harness.soak import events

    from kvhal.procs import free_port

    monkeypatch.setattr(events, "CHECK_S", 0.2)
    (gone, h_gone), (damaged, h_damaged) = _write(tmp_path, 1), _write(tmp_path, 2)
    server = SimpleNamespace(name="kvhal0", events_port=free_port(), replay_port=free_port())
    pub = kv_events.ZmqEventPublisher(0, endpoint=f"tcp://*:{server.events_port}",
                                      replay_endpoint=f"tcp://*:{server.replay_port}")
    t0 = time.monotonic()
    watch = events.EventWatch.of_fleet([server], str(tmp_path),
                                       {"secondary_tiers": [{"type": "fs"}]}, t0)
    try:
        watch.start()
        pub.publish(kv_events.KVEventBatch(ts=time.time(), events=[
            kv_events.BlockStored(block_hashes=[h], parent_block_hash=None,
                                  token_ids=list(range(128)), block_size=128, lora_id=None,
                                  medium="STORAGE", lora_name=None, locality="LOCAL")
            for h in (h_gone, h_damaged)]))
        _until(lambda: watch.ledger.tallies.get("fs") and watch.ledger.tallies["fs"].claims == 2,
               "the claims")
        _until(lambda: watch.ledger.checks >= 2, "a check that finds both files")
        start = time.monotonic() - t0
        with open(damaged, "r+b") as f:
            f.truncate(100)
        watch.faults.append({"kind": "fs_truncate", "start_s": start, "end_s": start,
                             "what": f"fs_truncate {damaged}"})
        os.unlink(gone)
        _until(lambda: watch.ledger.standing("missing") == 1, "the missing file")
        pub.publish(kv_events.KVEventBatch(ts=time.time(), events=[
            kv_events.BlockRemoved(block_hashes=[h_gone], medium="STORAGE",
                                   locality="LOCAL")]))
        _until(lambda: watch.ledger.tallies["fs"].retracted == 1, "the removal")
        report = watch.finish(settle_s=1.0)
    finally:
        pub.shutdown()
    fs = report["tiers"]["fs"]
    assert fs["became_unloadable"] == {"missing": 1, "damaged": 1, "unreachable": 0}
    assert fs["stale_retracted"] == 1 and fs["never_retracted"] == {"missing": 0, "damaged": 1, "unreachable": 0}
    end = time.monotonic() - t0
    assert end - start - 1.0 <= fs["max_never_retracted_s"] <= end - start + 0.1
    assert report["error"] is None and report["feeds"]["kvhal0"]["batches"] == 2


def test_a_killed_servers_claims_end_at_its_kill_as_a_routers_health_poll_drops_it(tmp_path):
    """Fails when a killed server's claims stand until its restart's first batch (its dead
    claims on files the other server evicts meanwhile would count as stale)."""
    from types import SimpleNamespace

    from kvhal.integrations.harness.soak.events import EventWatch

    servers = [SimpleNamespace(name=f"kvhal{i}", events_port=1, replay_port=2) for i in (0, 1)]
    watch = EventWatch.of_fleet(servers, str(tmp_path), {"secondary_tiers": [{"type": "fs"}]},
                                0.0)
    watch.ledger.stored("kvhal1", "fs", [5], 1.0)
    watch.ledger.check({"fs": {5: "ok"}}, 2.0)
    watch.faults.append({"kind": "kill_restart", "target": 1, "start_s": 3.0, "end_s": 3.0,
                         "what": "kvhal1 killed"})
    watch.faults.append({"kind": "stop_cont", "target": 0, "start_s": 4.0, "end_s": 16.0,
                         "what": "kvhal0 stopped"})
    watch._take_faults()
    report = watch.ledger.report(30.0)
    assert [(c["server"], c["at_s"], c["why"]) for c in report["clears"]] == [
        ("kvhal1", 3.0, "killed")]
    assert report["tiers"]["fs"]["retracted"] == 1


def test_obj_state_tells_good_damaged_and_missing_objects():
    """Against a real moto server: four chunk objects, one bit-flipped and one cut short (the
    same damage `kvhal fsck s3://` finds), one deleted. Fails when an object is judged by its
    listing alone, or a rewritten object keeps its cached verdict."""
    pytest.importorskip("obstore", reason="the obj tier needs the s3 extra")
    from kvhal.integrations.harness.soak.events import ObjState

    from conformance.s3 import shared_server

    from ..tiers.helpers import chunk_key
    from ..tiers.test_obj_cli import _bucket_with_damage
    from ..tiers.test_obj_tier import raw_client

    config, names = _bucket_with_damage(shared_server().endpoint)
    hashes = [external_hash(chunk_key(NAMESPACE, i).block_hash) for i in range(4)]
    state = ObjState(config)
    assert state.snapshot() == {hashes[0]: "ok", hashes[1]: "damaged", hashes[2]: "ok",
                                hashes[3]: "damaged"}
    client = raw_client(config)
    client.delete([names[2]])
    fixed = bytearray(client.get(names[1]))
    fixed[5000] ^= 0x10                                     # the flipped bit flipped back
    folder = names[1].rsplit("/", 1)[0] + "/"

    def modified():
        return {n: m for n, _, m in client.list(folder)}[names[1]]

    before = modified()
    deadline = time.monotonic() + 10.0
    while modified() == before:                     # moto stamps whole seconds

        assert time.monotonic() < deadline, "moto kept the object's last-modified time"
        client.put(names[1], memoryview(fixed), overwrite=True)
        time.sleep(0.1)
    assert state.snapshot() == {hashes[0]: "ok", hashes[1]: "ok", hashes[3]: "damaged"}


def test_obj_state_of_a_server_that_refuses_connections_is_unreachable():
    """Fails when a refused LIST is taken as "not checked" (a down S3 server's claims would
    never show) or as an empty bucket."""
    pytest.importorskip("obstore", reason="the obj tier needs the s3 extra")
    from kvhal.integrations.harness.soak.events import UNREACHABLE, ObjState

    from kvhal.procs import free_port

    state = ObjState({"type": "obj", "prefix": "soak", "store_config": {
        "bucket": "soak", "endpoint_override": f"http://127.0.0.1:{free_port()}",
        "region": "us-east-1", "access_key": "soak", "secret_key": "soak"}})
    assert state.snapshot() is UNREACHABLE


def test_obj_state_of_a_server_failing_its_gets_proves_nothing():
    """The hour's soak counted 597 obj claims "missing" past their bound: moto was killed
    between a check's LIST and its GETs, and every object whose GET failed was left out of the
    snapshot, i.e. taken as missing. Fails when a GET failing other than with 404 drops its
    object instead of voiding the snapshot."""
    pytest.importorskip("obstore", reason="the obj tier needs the s3 extra")
    from kvhal.integrations.harness.soak.events import ObjState

    from conformance.s3 import Fault, FaultyS3Proxy, shared_server

    from ..tiers.test_obj_cli import _bucket_with_damage

    server = shared_server()
    config, _ = _bucket_with_damage(server.endpoint)
    with FaultyS3Proxy(server.port) as proxy:
        via = config | {"store_config": config["store_config"] | {
            "endpoint_override": proxy.endpoint}}
        proxy.set_fault(Fault("status", methods=("GET",), status=503, code="SlowDown"))
        assert ObjState(via).snapshot() is None
        proxy.set_fault(None)
        assert len(ObjState(via).snapshot()) == 4
