"""The device pool's prefix cache: hits, LRU reuse, tail-first eviction."""
from __future__ import annotations

import tracemalloc

import pytest

from kvhal.integrations.harness.device_pool import DevicePool, DevicePoolError


def run(pool: DevicePool, hashes: list[bytes]) -> tuple[int, list[int]]:
    hit = pool.match_prefix(hashes)
    blocks = pool.acquire(hashes, hit)
    pool.release(hashes, blocks, len(hashes))
    return hit, blocks


def test_freed_blocks_stay_cached_until_reused():
    pool = DevicePool(4)
    assert run(pool, [b"a", b"b"]) == (0, [0, 1])
    assert run(pool, [b"a", b"b", b"c"]) == (2, [0, 1, 2])
    assert run(pool, [b"x"]) == (0, [3])


def test_tail_is_evicted_before_head():
    pool = DevicePool(3)
    run(pool, [b"a", b"b", b"c"])          # freed c, b, a: c is reused first
    assert run(pool, [b"x"]) == (0, [2])
    assert pool.match_prefix([b"a", b"b", b"c"]) == 2


def test_chunk_cached_beyond_an_evicted_prefix_keeps_its_block():
    pool = DevicePool(4)
    run(pool, [b"x"])                          # x in block 0; free: 1, 2, 3, 0(x)
    assert run(pool, [b"q", b"x"]) == (0, [1, 2])  # x is cached, but not as a prefix
    assert pool.acquire([b"x"], 1) == [0]      # still block 0; block 2 was freed unnamed
    pool.release([b"x"], [0], 1)               # free: 3, 2, 1(q), 0(x)
    run(pool, [b"r", b"s"])                    # reuses 3 and 2 (2 must not evict x)
    assert pool.match_prefix([b"x"]) == 1
    run(pool, [b"t", b"u"])                    # reuses 1 (q) and 0 (x)
    assert pool.match_prefix([b"x"]) == 0


def test_failed_chunks_are_not_cached():
    pool = DevicePool(2)
    blocks = pool.acquire([b"a", b"b"], 0)
    pool.release([b"a", b"b"], blocks, valid=1)
    assert pool.match_prefix([b"a", b"b"]) == 1


def test_request_larger_than_pool_names_the_option():
    with pytest.raises(DevicePoolError, match="--device-bytes: a request of 3 chunks does not "
                                              "fit a device pool of 2 blocks"):
        DevicePool(2).acquire([b"a", b"b", b"c"], 0)



def test_huge_pool_costs_nothing_until_used():
    # a pool of 2**20 blocks must not allocate per block up front (a dict of every block would
    # run the machine out of memory for --device-bytes 99999999999T)
    tracemalloc.start()
    try:
        pool = DevicePool(1 << 20)
        assert run(pool, [b"a", b"b"]) == (0, [0, 1])
        assert run(pool, [b"a", b"c"]) == (1, [0, 2])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 10, peak
