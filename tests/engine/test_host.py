"""Host tier: exact sizing, a region shared by a second process, slot states, LRU and ARC."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from kvhal.backends.cpu import CpuBackend
from kvhal.config import host_tail_bytes, parse_config
from kvhal.hal import MemoryKind
from kvhal.host import (ARCPolicy, HostRegion, HostRegionError, LRUPolicy, SlotTable,
                        host_geometry, host_layout)


def test_capacity_is_budget_over_slot_bytes_exactly():
    geo = host_geometry(chunk_nbytes=5000, cpu_bytes_to_use=100_000)
    assert (geo.slot_bytes, geo.capacity, geo.nbytes) == (8192, 12, 98_304)


def test_a_tier_asking_for_a_slot_tail_gets_it_only_when_configured():
    """A slot keeps the page-rounded tail the configured tiers ask for (mooncake: a record
    header), and only then: with fs alone a slot is its chunk's bytes, page-rounded."""
    fs = parse_config({"cpu_bytes_to_use": 1 << 20,
                       "secondary_tiers": [{"type": "fs", "root_dir": "/x"}]})
    both = parse_config({"cpu_bytes_to_use": 1 << 20,
                         "secondary_tiers": [{"type": "fs", "root_dir": "/x"},
                                             {"type": "mooncake"}]})
    assert (host_tail_bytes(fs), host_tail_bytes(both)) == (0, 4096)
    assert host_geometry(5000, 100_000, host_tail_bytes(fs)).slot_bytes == 8192
    assert host_geometry(5000, 100_000, host_tail_bytes(both)).slot_bytes == 12288
    assert host_geometry(5000, 100_000, 1).slot_bytes == 12288
    assert host_layout((5000, 4096), 1 << 20, None, 4096).pools[1].slot_bytes == 8192
    with pytest.raises(HostRegionError, match="tail_bytes must be >= 0, got -1"):
        host_geometry(5000, 100_000, -1)


def test_budget_below_one_slot_is_refused():
    with pytest.raises(HostRegionError, match="cpu_bytes_to_use=4095 holds no slot of 4096"):
        host_geometry(4096, 4095)


def test_region_is_allocated_at_its_exact_size():
    backend = CpuBackend()
    geo = host_geometry(3 * 4096, 7 * 3 * 4096)
    region = HostRegion.allocate(backend, geo)
    assert (region.allocation.nbytes, region.allocation.kind) == (7 * 3 * 4096, MemoryKind.PINNED)
    assert region.array.shape == (86_016,) and len(region.view) == 86_016
    region.close()


CHILD = """
import sys
import numpy as np
from kvhal.backends.cpu import CpuBackend
from kvhal.config import host_tail_bytes, parse_config
from kvhal.host import HostRegion, host_geometry
region = HostRegion.attach_shared(CpuBackend(), sys.argv[1], host_geometry(4096, 4 * 4096))
assert region.slot_array(2)[:4].tolist() == [1, 2, 3, 4], region.slot_array(2)[:4]
region.slot_array(3)[:] = 9
region.close()
"""


def _shm_names() -> set[str]:
    return set(os.listdir("/dev/shm"))


def test_shared_region_is_seen_by_another_process():
    backend = CpuBackend()
    before = _shm_names()
    region = HostRegion.create_shared(backend, host_geometry(4096, 4 * 4096), "kvhal-test")
    try:
        assert region.allocation.kind is MemoryKind.REGISTERED
        assert os.path.getsize(region.share_path) == 16384
        assert os.readlink(region.share_path).startswith("/memfd:kvhal-test")
        assert _shm_names() - before == set()
        region.slot_array(2)[:4] = [1, 2, 3, 4]
        subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD), region.share_path],
                       check=True)
        assert int(region.slot_array(3).sum()) == 9 * 4096
    finally:
        region.close()
    with pytest.raises(HostRegionError, match="cannot open shared region"):
        HostRegion.attach_shared(backend, region.share_path, host_geometry(4096, 4 * 4096))


CREATOR = """
import sys, time
from kvhal.backends.cpu import CpuBackend
from kvhal.config import host_tail_bytes, parse_config
from kvhal.host import HostRegion, host_geometry
region = HostRegion.create_shared(CpuBackend(), host_geometry(4096, 4 * 4096), "kvhal-killed")
region.slot_array(1)[:] = 7
print(region.share_path, flush=True)
time.sleep(600)
"""


def test_sigkilled_creator_leaves_nothing_in_dev_shm():
    before = _shm_names()
    creator = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CREATOR)],
                               stdout=subprocess.PIPE, text=True)
    try:
        path = creator.stdout.readline().strip()
        region = HostRegion.attach_shared(CpuBackend(), path, host_geometry(4096, 4 * 4096))
    finally:
        creator.kill()
        creator.wait()
    try:
        # the attached mapping keeps the bytes alive; no name outlives the creator
        assert int(region.slot_array(1).sum()) == 7 * 4096
        assert _shm_names() - before == set()
        with pytest.raises(HostRegionError, match="cannot open shared region"):
            HostRegion.attach_shared(CpuBackend(), path, host_geometry(4096, 4 * 4096))
    finally:
        region.close()


def test_attach_with_other_geometry_is_refused():
    region = HostRegion.create_shared(CpuBackend(), host_geometry(4096, 4 * 4096), "kvhal-test")
    try:
        with pytest.raises(HostRegionError, match="has 16384 bytes, expected 20480"):
            HostRegion.attach_shared(CpuBackend(), region.share_path,
                                     host_geometry(4096, 5 * 4096))
    finally:
        region.close()


def test_slot_states_follow_writers_and_readers():
    table = SlotTable(3, LRUPolicy(3))
    slots, _ = table.reserve(["a", "b"])
    assert slots == [0, 1] and table.state == [-1, -1, 0]
    table.commit(0)
    table.abort(1)
    table.acquire(0)
    table.acquire(0)
    assert table.state == [2, 0, 0] and table.index == {"a": 0} and table.num_free == 2
    table.discard("a")  # deferred: two readers
    assert table.index == {} and table.num_free == 2
    table.release(0)
    table.release(0)
    assert table.num_free == 3 and table.keys == [None, None, None]


def test_eviction_takes_only_idle_unprotected_slots():
    table = SlotTable(3, LRUPolicy(3))
    table.reserve(["a", "b", "c"])
    for s in range(3):
        table.commit(s)
    table.acquire(table.index["a"])            # reader on the oldest
    slots, evicted = table.reserve(["d", "e"], protect={"b"})
    assert evicted == ["c"] and slots == [2]   # "e" does not fit: a has a reader, b protected


def test_lru_evicts_least_recently_used():
    lru = LRUPolicy(4)
    for k in "abcd":
        lru.insert(k)
    lru.touch("a")
    assert lru.evict(2, lambda k: True) == ["b", "c"]
    assert lru.evict(5, lambda k: k != "d") == ["a"]


def test_arc_keeps_frequent_keys_and_adapts_on_ghost_hits():
    arc = ARCPolicy(4)
    for k in "abcd":
        arc.insert(k)
    arc.touch("a")
    arc.touch("b")                             # T1 = c d, T2 = a b
    assert arc.evict(1, lambda k: True) == ["c"]   # |T1| = 2 > p = 0: recency side first
    arc.insert("c")                            # ghost hit in B1: p grows, c enters T2
    assert arc.p == 1.0
    # |T1| = 1 is no longer above p = 1: the frequency side gives up its LRU keys first
    assert arc.evict(4, lambda k: True) == ["a", "b", "c", "d"]
