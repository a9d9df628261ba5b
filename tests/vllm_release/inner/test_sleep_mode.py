"""Sleep mode (vLLM >= 0.33): `KVHalConnector.supports_sleep_mode` is True, so vLLM lets
`--enable-sleep-mode` run with kvhal; before its sleep discards the device KV cache,
`unregister_kv_caches` must have let no store still read it, and `restore_kv_caches` must
refuse KV tensors that came back elsewhere.

vLLM's CPU platform has no sleep mode (`Platform.is_sleep_mode_available`: CUDA, ROCm, XPU), so
the worker's `sleep` is played by the connector calls vLLM's `Worker.sleep` / `wake_up` make,
with the device KV zeroed in between (what discarding it does to its bytes), on a cpu backend
whose copies each start 50 ms late (so a store is still in flight when the sleep begins).
Checked to fail: without the wait in `WorkerSide.unregister_kv_caches`, the store reads the
zeroed KV and the reload test fails.
"""
from __future__ import annotations

import time

import pytest
import torch

from kvhal import plugins
from kvhal.backends.cpu.backend import CpuBackend

from .rig import Rig, pattern, prompt

pytestmark = pytest.mark.engine


class FaultySlowBackend(CpuBackend):
    """A cpu backend on whose streams every copy batch waits 50 ms before it runs."""

    def copy_2d_batch_async(self, copies, stream):
        self._worker(stream).submit(lambda: time.sleep(0.05))
        super().copy_2d_batch_async(copies, stream)

    def copy_batch_async(self, dsts, srcs, sizes, stream):
        self._worker(stream).submit(lambda: time.sleep(0.05))
        super().copy_batch_async(dsts, srcs, sizes, stream)


@pytest.fixture
def backends(monkeypatch):
    """The `FaultySlowBackend`s the rig's worker side selected (one per `select_backend`)."""
    made: list[FaultySlowBackend] = []

    def select(name=None):
        made.append(FaultySlowBackend())
        return made[-1]

    monkeypatch.setattr(plugins, "select_backend", select)
    return made


@pytest.fixture
def rig(backends):
    rig = Rig("full", {"cpu_bytes_to_use": 32 << 20})
    yield rig
    rig.close()


def _sleep_and_wake(rig, backends=()) -> int:
    """vLLM's sleep and wake-up as the connector sees them: `unregister_kv_caches`, the device
    KV discarded (zeroed), every stream of `backends` flushed (a copy still queued lands now),
    `restore_kv_caches`. Returns the KV elements non-zero after the flush."""
    rig.worker.unregister_kv_caches()
    for tensor in rig.kv_caches.values():
        tensor.zero_()
    for backend in backends:
        for stream in list(backend._workers):
            stream.synchronize()
    written = sum(int(t.count_nonzero()) for t in rig.kv_caches.values())
    rig.worker.restore_kv_caches()
    return written


def test_connector_declares_sleep_mode():
    from kvhal.integrations.vllm.connector import KVHalConnector

    assert KVHalConnector.supports_sleep_mode(None) is True


def test_stores_in_flight_at_sleep_finish_before_the_kv_is_discarded(rig):
    tokens = prompt(4, 100)
    slept = []

    def sleep(meta) -> None:        # right after a's stores were issued
        if meta.stores and not slept:
            _sleep_and_wake(rig)
            slept.append(len(meta.stores))

    rig.add("a", tokens)
    rig.run(after_save=sleep)
    assert slept == [1]
    assert rig.scheduler.reset_prefix_cache()
    first = len(rig.stats)
    rig.add("b", tokens)
    rig.run()
    assert sum(s.connector_prefix_cache_stats.hits for s in rig.stats[first:]) == 96
    blocks = rig.blocks["b"][0]
    for name, layer in rig.layer_index.items():
        for p in range(96):
            row = rig.attention_row(name, blocks[p // 16], p % 16)
            assert (row == pattern(tokens[p], p, layer)).all(), (name, p)


def test_loads_in_flight_at_sleep_land_before_the_kv_is_discarded(rig, backends):
    """b's synchronous loads from the host tier are issued (each copy 50 ms late) when the
    sleep begins: `unregister_kv_caches` must return only once they have written the device
    KV, so that no copy writes it after vLLM discarded it (on a GPU: memory unmapped or handed
    to another allocation). After the sleep the device KV is zeroed and every stream of the
    backend flushed: it must still be all zeros. Seen failing with the wait in
    `WorkerSide.unregister_kv_caches` removed (the loads landed after the zeroing: 98,048
    non-zero elements)."""
    tokens = prompt(4, 100)
    rig.add("a", tokens)
    rig.run()
    assert rig.scheduler.reset_prefix_cache()
    late = []

    def sleep(meta) -> None:        # right after b's loads were issued
        if meta.loads and not late:
            late.append(_sleep_and_wake(rig, backends))

    rig.add("b", tokens)
    rig.run(after_load=sleep)
    assert late == [0]


def test_restore_refuses_kv_tensors_that_moved(rig):
    rig.worker.unregister_kv_caches()
    name = next(iter(rig.kv_caches))
    moved = torch.empty_like(rig.kv_caches[name])
    rig.kv_caches[name].set_(moved)
    with pytest.raises(RuntimeError, match=rf"{name}: KV cache moved from 0x"):
        rig.worker.restore_kv_caches()
