"""The fleet router's prefix index and policies (`integrations/pd/prefix_index.py`,
`route.py`), fed real event bytes: vLLM's own msgspec classes encoded as its publisher
encodes them, decoded by the router's structs."""
from __future__ import annotations

import pytest

pytest.importorskip("msgspec", reason="the router needs the `proxy` extra")
kv_events = pytest.importorskip("vllm.distributed.kv_events",
                                reason="vLLM's event classes encode the test events")

import msgspec
from kvhal.integrations.pd.backends import Backend, NoHealthyBackend, P2PAddress
from kvhal.integrations.pd.events_sub import _DECODER
from kvhal.integrations.pd.prefix_index import (
    EventError,
    InstanceIndex,
    prefix_keys,
    root_key,
)
from kvhal.integrations.pd.route import (
    AFFINITY_TOKENS,
    Instance,
    InstanceSpec,
    Router,
    conversation_of,
    parse_instance,
)

B = 16      # vLLM's block size in these events
TOKENS = list(range(1000, 1000 + 6 * B))      # a 6-block prompt


def wire(*events) -> list:
    """`events` (vLLM's classes) through vLLM's msgpack encoding and the router's decoder."""
    raw = msgspec.msgpack.Encoder().encode(kv_events.KVEventBatch(ts=0.0, events=list(events)))
    return _DECODER.decode(raw).events


def stored(hashes, parent, tokens, size=B, medium="GPU", **kw):
    return kv_events.BlockStored(block_hashes=hashes, parent_block_hash=parent,
                                 token_ids=tokens, block_size=size, lora_id=None,
                                 medium=medium, lora_name=None, **kw)


def device_blocks(index: InstanceIndex, n: int, tokens=TOKENS) -> None:
    """vLLM's device events for the first n blocks of `tokens` (engine hashes b"d0"...)."""
    for e in wire(stored([f"d{i}".encode() for i in range(n)], None, tokens[:n * B])):
        index.apply(e)


def test_device_blocks_credit_their_full_prefixes():
    index = InstanceIndex()
    device_blocks(index, 3)
    assert index.hits(prefix_keys(TOKENS)) == {"device": 3 * B, "host": 0, "disk": 0,
                                               "shared": 0}
    other = TOKENS[:2 * B] + [7] * (4 * B)      # shares 2 blocks
    assert index.hits(prefix_keys(other))["device"] == 2 * B
    assert index.hits(prefix_keys(TOKENS[:B - 1]))["device"] == 0


def test_chunk_events_credit_only_announced_chunk_ends():
    """Contract A: one `BlockStored` per chunk of 2 blocks (`block_size` 32, the chunk's last
    block hash, parent = the block before the chunk). A prompt sharing 3 blocks is predicted
    2 host blocks (kvhal can load chunk 0 only), not 3. Fails when the index credits inside an
    event's block (e.g. per vLLM block of the chunk)."""
    index = InstanceIndex()
    device_blocks(index, 1)
    for e in wire(stored([b"c1"], None, TOKENS[:2 * B], size=2 * B, medium="CPU"),
                  stored([b"c3"], b"c1", TOKENS[2 * B:4 * B], size=2 * B, medium="CPU")):
        index.apply(e)
    three = TOKENS[:3 * B] + [7] * (3 * B)
    assert index.hits(prefix_keys(three)) == {"device": B, "host": B, "disk": 0, "shared": 0}
    assert index.hits(prefix_keys(TOKENS))["host"] == 3 * B
    assert index.prefix(prefix_keys(TOKENS), "host") == 4 * B


def test_per_block_host_events_with_ownership_are_accepted():
    """kvhal's events before contract A: per-block hashes of a chunk, `ownership` = tier
    label; ownership is ignored, STORAGE is disk, STORAGE + REMOTE and CPU + REMOTE (a
    mooncake pool) are shared."""
    index = InstanceIndex()
    for e in wire(stored([b"h0", b"h1"], None, TOKENS[:2 * B], medium="CPU", ownership="cpu"),
                  stored([b"s0", b"s1", b"s2"], None, TOKENS[:3 * B], medium="STORAGE",
                         ownership="fs"),
                  stored([b"r0", b"r1", b"r2", b"r3"], None, TOKENS[:4 * B],
                         medium="STORAGE", locality="REMOTE"),
                  stored([b"m0", b"m1", b"m2", b"m3", b"m4"], None, TOKENS[:5 * B],
                         medium="CPU", locality="REMOTE")):
        index.apply(e)
    assert index.hits(prefix_keys(TOKENS)) == {"device": 0, "host": 2 * B, "disk": B,
                                               "shared": 2 * B}


def test_removed_blocks_orphans_and_token_less_events():
    index = InstanceIndex()
    device_blocks(index, 3)
    (removed,) = wire(kv_events.BlockRemoved(block_hashes=[b"d2"], medium="GPU"))
    index.apply(removed)
    assert index.prefix(prefix_keys(TOKENS), "device") == 2 * B
    # a parent never seen: dropped, counted
    for e in wire(stored([b"x"], b"unknown", TOKENS[3 * B:4 * B])):
        index.apply(e)
    assert index.orphans == 1 and index.prefix(prefix_keys(TOKENS), "device") == 2 * B
    # no token ids: known hashes credited (d2 back on the host tier), unknown counted
    for e in wire(stored([b"d2", b"nope"], b"d1", [], medium="CPU")):
        index.apply(e)
    assert index.prefix(prefix_keys(TOKENS), "host") == 3 * B and index.orphans == 2
    (cleared,) = wire(kv_events.AllBlocksCleared())
    index.apply(cleared)
    assert index.counts() == {"device": 0, "host": 0, "disk": 0, "shared": 0}


def test_a_placeholder_event_credits_the_hashes_the_index_knows():
    """kvhal announces a chunk a tier found without its description (an object another
    instance stored in a shared bucket) as a placeholder: `block_size` 0, no token ids. Fails
    when the whole event is refused as a bad block size (seen in `kvhal soak`: "event
    skipped ... block_size ... got 0"), so a known chunk is not credited to the shared tier."""
    index = InstanceIndex()
    device_blocks(index, 3)
    for e in wire(stored([b"d2", b"nope"], None, [], size=0, medium="STORAGE",
                         locality="REMOTE")):
        index.apply(e)
    assert index.prefix(prefix_keys(TOKENS), "shared") == 3 * B and index.orphans == 1


def test_bad_events_raise_naming_the_field():
    index = InstanceIndex()
    with pytest.raises(EventError, match="medium: unknown 'TAPE'"):
        index.apply(wire(stored([b"a"], None, TOKENS[:B], medium="TAPE"))[0])
    with pytest.raises(EventError, match="block_size"):
        index.apply(wire(stored([b"a"], None, TOKENS[:B], size=0))[0])


def fleet(n=2, p2p=True) -> list[Instance]:
    return [Instance(InstanceSpec(f"http://127.0.0.1:{9000 + i}", None, None,
                                  P2PAddress("127.0.0.1", 7000 + i) if p2p else None),
                     Backend(f"http://127.0.0.1:{9000 + i}")) for i in range(n)]


def test_kv_routes_to_the_holder_until_its_load_outweighs_the_prefix():
    a, b = fleet()
    device_blocks(b.index, 6)
    router = Router([a, b], "kv", load_tokens=B)
    first = router.choose(TOKENS, None)
    assert (first.instance, first.reason, first.predicted) == (b, "kv", {"device": 6 * B})
    assert router.choose(TOKENS, None).instance is b       # 1 in flight: 16 < 96 tokens
    b.backend.outstanding = 13          # 13 * 16 > 96 computed at a, charged twice: elsewhere
    assert router.choose(TOKENS, None).instance is a


def test_kv_counts_the_prompt_tokens_requests_in_flight_compute_until_they_end():
    """A long fresh prompt in flight on the holder outweighs its 6-block prefix; once it
    ends, the holder wins again. Fails when the router weighs requests in flight only by
    their count (the holder would win with its own request in flight)."""
    a, b = fleet()
    device_blocks(b.index, 6)
    router = Router([a, b], "kv", load_tokens=1)
    a.backend.outstanding = 1       # the fresh prompt goes to b by load
    fresh = router.choose(list(range(3000, 3000 + 20 * B)), None)
    a.backend.outstanding = 0
    assert (fresh.instance, fresh.compute, b.pending) == (b, 20 * B, 20 * B)
    moved = router.choose(TOKENS, None)     # b: 0 + 320 pending + 1 > a: 96 + 0 + 0
    assert (moved.instance, moved.compute, a.pending) == (a, 6 * B, 6 * B)
    for d in (fresh, moved):
        d.instance.backend.outstanding -= 1
        Router.finished(d)
    assert (a.pending, b.pending) == (0, 0)
    back = router.choose(TOKENS, None)
    assert (back.instance, back.compute, back.predicted) == (b, 0, {"device": 6 * B})


def test_no_prefix_anywhere_routes_by_load_and_unknown_tokens_fall_back():
    a, b = fleet()
    a.backend.outstanding = 1
    router = Router([a, b], "kv")
    assert (router.choose(TOKENS, None).instance, b.by_reason["load"]) == (b, 1)
    b.queued = 5       # its /metrics queue counts too
    assert router.choose(None, None).instance is a and a.by_reason["fallback"] == 1


def test_kv_p2p_sends_a_busy_holders_prefix_to_a_free_instance_with_remote_kv_source():
    """Fails without kv-p2p's pull credit (the request would stay on the busy holder or go
    to `a` without `remote_kv_source`)."""
    a, b = fleet()
    for e in wire(stored([b"h1"], None, TOKENS[:2 * B], size=2 * B, medium="CPU"),
                  stored([b"h2"], b"h1", TOKENS[2 * B:6 * B], size=4 * B, medium="CPU")):
        b.index.apply(e)
    b.backend.outstanding = 3
    router = Router([a, b], "kv-p2p", load_tokens=40, p2p_busy=2, p2p_min_tokens=32)
    d = router.choose(TOKENS, None)
    assert (d.instance, d.reason, d.predicted) == (a, "p2p", {"p2p": 6 * B})
    source = d.kv_transfer["remote_kv_source"]
    assert (source["remote_host"], source["remote_port"]) == ("127.0.0.1", 7001)
    assert len(source["kv_request_id"]) == 32
    b.backend.outstanding = 1      # not busy: served by the holder itself
    assert router.choose(TOKENS, None).instance is b
    plain = Router([a, b], "kv", load_tokens=40)
    b.backend.outstanding = 3
    assert plain.choose(TOKENS, None).kv_transfer is None


def test_unhealthy_instances_are_routed_around_and_none_left_raises():
    a, b = fleet()
    device_blocks(b.index, 6)
    b.backend.mark(False, "connection refused")
    router = Router([a, b], "kv")
    assert router.choose(TOKENS, None).instance is a
    with pytest.raises(NoHealthyBackend, match="connection refused"):
        router.choose(TOKENS, None, exclude=(a,))


def test_affinity_keeps_a_conversation_on_its_instance_and_round_robin_alternates():
    a, b = fleet()
    router = Router([a, b], "affinity")
    conv = conversation_of({"user": "alice"}, TOKENS)
    first = router.choose(TOKENS, conv).instance
    b.backend.outstanding = a.backend.outstanding = 0
    assert [router.choose(TOKENS, conv).instance for _ in range(3)] == [first] * 3
    turn1 = list(range(AFFINITY_TOKENS + 1))     # a later turn extends the prompt
    assert conversation_of({"prompt": turn1 + [1]}, turn1 + [1]) == conversation_of(
        {"prompt": turn1}, turn1) != conversation_of({"prompt": TOKENS}, TOKENS)
    rr = Router(fleet(), "round-robin")
    assert [rr.choose(TOKENS, None).instance.spec.url[-4:] for _ in range(3)] == [
        "9000", "9001", "9000"]


@pytest.mark.parametrize("spec, why", [
    ("http://h:1,events=udp://x:1", "ZMQ endpoint"),
    ("http://h:1,replay=tcp://x:2", "replay= needs events="),
    ("http://h:1,p2p=h:0", "p2p must be HOST:PORT"),
    ("http://h:1,color=red", "not one of"),
    ("h:1", "http"),
    ("http://h:1,events=tcp://*:5557", "the instance's host"),
    ("http://h:1,events=tcp://h:5557,replay=tcp://0.0.0.0:5558", "the instance's host"),
    ("http://h:1,events=tcp://", "tcp://HOST:PORT"),
    ("http://h:1,events=tcp://h:port", "tcp://HOST:PORT"),
    ("http://h:1,events=tcp://h:70000", "tcp://HOST:PORT"),
    ("http://h:1,events=ipc://", "ipc://PATH"),
], ids=["scheme", "replay-alone", "port", "key", "url", "wildcard", "any-address",
        "no-address", "port-name", "port-range", "no-path"])
def test_bad_instance_specs_are_refused_naming_the_part(spec, why):
    import argparse
    with pytest.raises(argparse.ArgumentTypeError, match=why):
        parse_instance(spec)


def test_instance_spec_parts():
    assert parse_instance("http://10.0.0.5:8001/,events=tcp://10.0.0.5:5557,"
                          "replay=tcp://10.0.0.5:5558,p2p=10.0.0.5:7001") == InstanceSpec(
        "http://10.0.0.5:8001", "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558",
        P2PAddress("10.0.0.5", 7001))


def test_a_salted_prompt_and_an_unsalted_one_never_share_keys():
    """vLLM puts the cache salt in the first block's extra keys; fails when the index starts
    every chain at the same root (the unsalted prompt would be credited the salted blocks)."""
    index = InstanceIndex()
    for e in wire(stored([b"s0", b"s1"], None, TOKENS[:2 * B], extra_keys=[("salt",), None]),
                  stored([b"s2"], b"s1", TOKENS[2 * B:3 * B])):
        index.apply(e)
    assert index.prefix(prefix_keys(TOKENS), "device") == 0
    assert index.prefix(prefix_keys(TOKENS, root_key(("salt",))), "device") == 3 * B
    assert index.prefix(prefix_keys(TOKENS, root_key(("other",))), "device") == 0


class _Hashed(int):
    """A prompt token that counts how often it is hashed (the router's per-request work)."""

    count = 0

    def __hash__(self):
        _Hashed.count += 1
        return int.__hash__(self)


@pytest.mark.parametrize("policy", ["kv", "kv-p2p"])
def test_a_huge_prompt_costs_the_router_only_the_longest_prefix_it_could_hit(policy):
    """The router runs on one event loop: hashing every token of a 256 MiB prompt (vLLM
    refuses it later) stalls every other request and health poll for seconds. Fails when
    tokens past the longest prefix any instance holds are hashed."""
    instances = fleet()
    device_blocks(instances[1].index, 2)
    huge = TOKENS[:2 * B] + [_Hashed(t) for t in range(100_000)]
    decision = Router(instances, policy).choose(huge, None)
    assert (decision.instance, decision.predicted) == (instances[1], {"device": 2 * B})
    assert decision.expects_store
    assert _Hashed.count == 0
