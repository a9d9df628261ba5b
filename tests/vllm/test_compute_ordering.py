"""The worker side orders its copies on the compute stream (DESIGN §5): a store waits for the
forward that wrote its KV, attention waits for a load's copies.

The cpu backend stands in for a GPU: in chaos mode, with a simulated compute stream (a stream
of the worker side's own backend, handed in as its `ComputeStream`), and the late side of each
scenario (the forward's writes, a load, an earlier attention) held back by `FaultyHeldStreams`
until everything not ordered after it has run. `test_without_the_ordering_the_bytes_are_stale`
is the negative control: each scenario with the connector's event or stream wait replaced by
nothing reads exactly the stale bytes, every seed. The KV tensors are real torch CPU tensors in vLLM-CPU's layout, the host region a real shared
region, the jobs real `KVHalMetadata`. `test_cuda_*` run the same scenarios on torch's current
CUDA/HIP stream (a delay kernel, a large load), and skip without a GPU.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the connector's metadata subclasses vLLM's (vllm extra)")

import torch  # noqa: E402

from kvhal import plugins  # noqa: E402
from kvhal.backends.cpu import CpuBackend  # noqa: E402
from kvhal.hal import Stream, host_array  # noqa: E402
from kvhal.host import HostRegion, host_geometry, host_layout  # noqa: E402
from kvhal.integrations.vllm.compute import ComputeStream  # noqa: E402
from kvhal.integrations.vllm.geometry import Deployment, GroupInfo  # noqa: E402
from kvhal.integrations.vllm.metadata import KVHalMetadata, RegionInfo, TransferJob  # noqa: E402
from kvhal.integrations.vllm.worker import WorkerSide  # noqa: E402
from kvhal.layout import attention_spec, chunk_layout  # noqa: E402

from ..engine.rig import CopyHookBackend  # noqa: E402


LAYERS = ("layer.0", "layer.1")
NUM_BLOCKS, HEADS, BLOCK_TOKENS, HEAD_SIZE, BLOCKS_PER_CHUNK = 8, 2, 16, 8, 2
SRC_BLOCKS, DST_BLOCKS = np.array([[0, 1]]), np.array([[2, 3]])
#: `torch.cuda._sleep` cycles ahead of the forward's writes: about 0.5 s at 2 GHz.
SLEEP_CYCLES = 1 << 30
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="needs a CUDA or ROCm GPU (torch.cuda.is_available() is "
                                      "False): orders copies on torch's current stream")
SEEDS = range(10)


@dataclass
class Rank:
    """One TP rank's worker side over real KV tensors, and the scheduler's shared region."""

    side: WorkerSide
    kv: dict[str, Any]           # layer name → KV tensor
    region: HostRegion           # the scheduler's
    info: RegionInfo

    def meta(self, **jobs) -> KVHalMetadata:
        return KVHalMetadata(self.info, **jobs)

    def store(self, job_id: int, blocks: np.ndarray) -> None:
        """Start a store of `blocks` (n, BLOCKS_PER_CHUNK) into slots 0..n-1, as vLLM does
        after the forward."""
        self.side.wait_for_save(self.meta(stores=[_job(job_id, blocks)]))

    def start_load(self, job_id: int, blocks: np.ndarray, layer_waits: bool = True) -> None:
        """Issue a synchronous load of slots 0..n-1 into `blocks` (n, BLOCKS_PER_CHUNK) and,
        with `layer_waits`, order attention after it as vLLM's attention layers do; without,
        as a full CUDA graph replays the forward (no per-layer connector calls)."""
        self.side.start_load_kv(self.meta(loads=[_job(job_id, blocks)]))
        if layer_waits:
            self.side.wait_for_layer_load()

    def ended(self, job_id: int, timeout_s: float = 10.0) -> int:
        """Poll `get_finished` until job `job_id` has ended on this rank; its `num_ok`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.side.get_finished()
            meta = self.side.take_worker_meta()
            if meta is not None and job_id in meta.ranks_done:
                return meta.num_ok[job_id]
            time.sleep(0.001)
        raise TimeoutError(f"job {job_id} did not end within {timeout_s} s")

    def blocks(self, blocks: np.ndarray) -> np.ndarray:
        """Bytes of `blocks` in every layer (uint8, layers concatenated)."""
        return np.concatenate([_bytes(self.kv[name][_index(blocks)]) for name in LAYERS])

    def close(self) -> None:
        self.side.close()
        self.region.close()


def _job(job_id: int, blocks: np.ndarray) -> TransferJob:
    return TransferJob(job_id, "req", 0, np.arange(len(blocks)), blocks)


def _index(blocks: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(blocks.ravel())


def _bytes(tensor) -> np.ndarray:
    return tensor.cpu().contiguous().view(torch.uint8).numpy().ravel()


def _deployment(heads: int, head_size: int) -> Deployment:
    spec = attention_spec(num_layers=len(LAYERS), num_kv_heads=heads, head_size=head_size,
                          dtype="fp16", block_size=BLOCK_TOKENS)
    group = GroupInfo(0, spec, LAYERS, chunk_layout(spec, BLOCKS_PER_CHUNK).chunk_bytes)
    return Deployment((group,), BLOCK_TOKENS, BLOCKS_PER_CHUNK, 1, "fp16", "sha256", "0",
                      "LBHNC")


def _rank(device: str, compute: Callable[[Any], ComputeStream] | None = None, *,
          heads: int = HEADS, head_size: int = HEAD_SIZE, num_blocks: int = NUM_BLOCKS) -> Rank:
    """A worker side whose KV tensors (zeros, fp16, vLLM's LBHNC view `(num_blocks, heads,
    block_size, 2 * head_size)`, read by vLLM's CPU backend on "cpu" and by FlashAttention on
    "cuda") are registered, attached to a fresh shared region of a slot per chunk; `compute`
    as `WorkerSide`'s (None: its default)."""
    dep = _deployment(heads, head_size)
    slot_bytes = host_geometry(dep.chunk_nbytes[0], 1 << 40).slot_bytes
    layout = host_layout(dep.chunk_nbytes, num_blocks // BLOCKS_PER_CHUNK * slot_bytes)
    region = HostRegion.create_shared(CpuBackend(), layout, "kvhal-test-ordering")
    side = WorkerSide(dep, 0) if compute is None else WorkerSide(dep, 0, compute)
    kv_shape = (num_blocks, heads, BLOCK_TOKENS, 2 * head_size)
    kv = {name: torch.zeros(kv_shape, dtype=torch.float16, device=device) for name in LAYERS}
    if device == "cpu":
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend as backend
    else:
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend as backend
    side.register_kv_caches(kv, {name: SimpleNamespace(attn_backend=backend)
                                 for name in LAYERS})
    rank = Rank(side, kv, region, RegionInfo(region.share_path, layout))
    side.start_load_kv(rank.meta())   # attach the region: the compute stream is made now
    return rank


class FaultyHeldStreams(CopyHookBackend):
    """A cpu backend in chaos mode on which copies queued on a stream that `late(stream)`
    picks, while the test holds them (`hold()` … `release()`), start only once the test has
    released them and every other stream of the backend has run all it can: each is idle or
    blocked in a stream wait on an event not yet complete. Such a copy is as late as it can
    be by construction (not by a sleep): work that raced it without a stream wait has run
    first, every time, whatever chaos mode's delays."""

    #: A held copy whose other streams never go quiet raises after this long (a hang).
    HOLD_TIMEOUT_S = 10.0

    def __init__(self, late: Callable[[Stream], bool], chaos_seed: int):
        super().__init__(chaos_seed=chaos_seed)
        self.late = late
        self._open = threading.Event()
        self._open.set()
        self._waiting: set = set()          # stream workers blocked in a stream wait
        self._waiting_lock = threading.Lock()

    def hold(self) -> None:
        """Hold copies queued on late streams from now on until `release`."""
        self._open.clear()

    def release(self) -> None:
        """Let held copies start once the other streams are quiet."""
        self._open.set()

    def stream_wait_event(self, stream: Stream, event) -> None:
        worker, mark = self._worker(stream), self._event(event).mark
        if mark is None:
            return

        def wait() -> None:
            with self._waiting_lock:
                self._waiting.add(worker)
            try:
                mark.done.wait()
            finally:
                with self._waiting_lock:
                    self._waiting.discard(worker)

        worker.submit(wait)

    def _quiet(self, me) -> bool:
        with self._lock:
            others = [w for w in self._workers if w is not me]
        with self._waiting_lock:
            waiting = set(self._waiting)
        return all(w in waiting or w.idle() for w in others)

    def before_copy(self, stream: Stream) -> None:
        if not self.late(stream) or self._open.is_set():
            return
        me = self._worker(stream)

        def held() -> None:
            deadline = time.monotonic() + self.HOLD_TIMEOUT_S
            while not (self._open.is_set() and self._quiet(me)):
                if time.monotonic() > deadline:
                    raise TimeoutError("held copy: the other streams never went quiet")
                time.sleep(0.0002)

        me.submit(held)


def _cpu_rank(monkeypatch, seed: int, late: Callable[[Stream, Stream], bool]
              ) -> tuple[Rank, FaultyHeldStreams, Stream]:
    """A rank on a `FaultyHeldStreams` in chaos mode (seed `seed`; `plugins.select_backend`,
    by which `register_kv_caches` picks the backend, returns it) whose compute stream is a
    stream `sim` of that backend; copies on a stream s are held where `late(s, sim)`."""
    sim: list[Stream] = []
    backend = FaultyHeldStreams(lambda s: late(s, sim[0]), chaos_seed=seed)
    sim.append(backend.create_stream())
    monkeypatch.setattr(plugins, "select_backend", lambda name: backend)
    return _rank("cpu", lambda be: ComputeStream(be, lambda: sim[0])), backend, sim[0]


def _is(stream: Stream, sim: Stream) -> bool:
    return stream.handle is sim.handle


def _random_kv(rank: Rank, seed: int, blocks: np.ndarray = SRC_BLOCKS) -> torch.Tensor:
    """Random fp16 bits for `blocks` of one layer, on the host (any bit pattern: bytes are
    compared)."""
    shape = rank.kv[LAYERS[0]][_index(blocks)].shape
    bits = np.random.default_rng(seed).integers(0, 1 << 16, int(np.prod(shape)), dtype=np.uint16)
    return torch.from_numpy(bits.view(np.float16).reshape(shape))


@dataclass(frozen=True)
class Outcome:
    """What a scenario read (`got`), what it must read with the ordering (`want`), and what it
    reads where the ordering is missing (`stale`); uint8 arrays."""

    got: np.ndarray
    want: np.ndarray
    stale: np.ndarray


def store_after_late_forward(monkeypatch, seed: int) -> Outcome:
    """The forward's layers write KV on the compute stream, held; the store is issued (as
    `wait_for_save` is, after the forward was queued), then the forward may run. The stored
    chunk is reloaded into other blocks to compare."""
    rank, backend, sim = _cpu_rank(monkeypatch, seed, late=_is)
    new = {name: _random_kv(rank, seed * 7 + i) for i, name in enumerate(LAYERS)}
    sources = [backend.register_host(t.data_ptr(), t.nbytes) for t in new.values()]
    try:
        stale = rank.blocks(SRC_BLOCKS)
        backend.hold()
        for name, t in new.items():      # the forward: each layer writes its KV, late
            dst = rank.kv[name][int(SRC_BLOCKS[0, 0])]
            backend.copy_async(dst.data_ptr(), t.data_ptr(), t.nbytes, sim)
        rank.store(1, SRC_BLOCKS)
        backend.release()
        assert rank.ended(1) == 1
        rank.start_load(2, DST_BLOCKS)
        rank.side.wait_for_save(rank.meta())
        return Outcome(rank.blocks(DST_BLOCKS),
                       np.concatenate([_bytes(t) for t in new.values()]), stale)
    finally:
        backend.destroy_stream(sim)
        for allocation in sources:
            backend.free(allocation)
        rank.close()


def attention_after_late_load(monkeypatch, seed: int, layer_waits: bool = True) -> Outcome:
    """A load's copies are held; attention's read of the loaded blocks is queued on the
    compute stream after `wait_for_layer_load` (without `layer_waits`: right after
    `start_load_kv`, as in a full CUDA graph), then the load may run."""
    rank, backend, sim = _cpu_rank(monkeypatch, seed, late=lambda s, sim: not _is(s, sim))
    out = backend.alloc_pinned(len(rank.blocks(DST_BLOCKS)))
    try:
        for i, name in enumerate(LAYERS):
            rank.kv[name][_index(SRC_BLOCKS)] = _random_kv(rank, seed * 7 + i)
        rank.store(1, SRC_BLOCKS)
        assert rank.ended(1) == 1
        expected = rank.blocks(SRC_BLOCKS)
        for t in rank.kv.values():
            t.view(torch.int16)[_index(DST_BLOCKS)] = -1
        stale = rank.blocks(DST_BLOCKS)
        backend.hold()
        rank.start_load(2, DST_BLOCKS, layer_waits)
        offset = 0
        for name in LAYERS:              # attention reads the loaded blocks, on the stream
            first = rank.kv[name][int(DST_BLOCKS[0, 0])]
            nbytes = first.nbytes * DST_BLOCKS.size
            backend.copy_async(out.ptr + offset, first.data_ptr(), nbytes, sim)
            offset += nbytes
        backend.release()
        backend.stream_synchronize(sim)
        rank.side.wait_for_save(rank.meta())
        return Outcome(host_array(out).copy(), expected, stale)
    finally:
        backend.destroy_stream(sim)
        backend.free(out)
        rank.close()


def load_after_late_compute(monkeypatch, seed: int) -> Outcome:
    """The last step's attention, queued on the compute stream and held, still reads blocks
    vLLM has freed and now hands to a load; the load is issued, then attention may run: it
    must read the blocks' old bytes (and the load must land afterwards)."""
    rank, backend, sim = _cpu_rank(monkeypatch, seed, late=_is)
    out = backend.alloc_pinned(len(rank.blocks(DST_BLOCKS)))
    try:
        for i, name in enumerate(LAYERS):
            rank.kv[name][_index(SRC_BLOCKS)] = _random_kv(rank, seed * 7 + i)
        rank.store(1, SRC_BLOCKS)
        assert rank.ended(1) == 1
        loaded = rank.blocks(SRC_BLOCKS)
        for t in rank.kv.values():
            t.view(torch.int16)[_index(DST_BLOCKS)] = -1
        old = rank.blocks(DST_BLOCKS)
        backend.hold()
        offset = 0
        for name in LAYERS:              # the earlier attention reads the blocks, late
            first = rank.kv[name][int(DST_BLOCKS[0, 0])]
            nbytes = first.nbytes * DST_BLOCKS.size
            backend.copy_async(out.ptr + offset, first.data_ptr(), nbytes, sim)
            offset += nbytes
        rank.start_load(2, DST_BLOCKS)
        backend.release()
        backend.stream_synchronize(sim)
        rank.side.wait_for_save(rank.meta())
        assert np.array_equal(rank.blocks(DST_BLOCKS), loaded)     # the load did land
        return Outcome(host_array(out).copy(), old, loaded)
    finally:
        backend.destroy_stream(sim)
        backend.free(out)
        rank.close()


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed{s}")
def test_store_holds_the_kv_a_late_forward_wrote(monkeypatch, seed):
    """A store issued after a forward still queued on the compute stream copies what the
    forward wrote, byte for byte. Without the event the store waits on, it copies the stale
    zeros (`test_without_the_ordering_the_bytes_are_stale[store-...]`)."""
    outcome = store_after_late_forward(monkeypatch, seed)
    np.testing.assert_array_equal(outcome.got, outcome.want)


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed{s}")
def test_attention_on_the_compute_stream_reads_the_loaded_kv(monkeypatch, seed):
    """An "attention read" queued on the compute stream after `wait_for_layer_load` reads the
    bytes a late load wrote. Without the stream wait it reads the stale 0xFF bytes
    (`test_without_the_ordering_the_bytes_are_stale[attention-...]`)."""
    outcome = attention_after_late_load(monkeypatch, seed)
    np.testing.assert_array_equal(outcome.got, outcome.want)


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed{s}")
def test_attention_in_a_full_cuda_graph_reads_the_loaded_kv(monkeypatch, seed):
    """As above, with `wait_for_layer_load` never called: vLLM's full CUDA graphs (its
    default mode replays one for a batch of 1-token steps) replay without the per-layer
    connector calls, so `start_load_kv` itself must queue the compute stream's wait. Seen
    failing (the stale 0xFF bytes, every seed) with the wait left to `wait_for_layer_load`."""
    outcome = attention_after_late_load(monkeypatch, seed, layer_waits=False)
    np.testing.assert_array_equal(outcome.got, outcome.want)


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed{s}")
def test_a_load_lands_after_earlier_compute_reading_its_blocks(monkeypatch, seed):
    """Work queued on the compute stream before a load (the last step's attention, late,
    still reading blocks now handed to the load) reads the blocks' old bytes: the load waits
    for it. Without the event the load waits on, that attention reads the loaded bytes
    (`test_without_the_ordering_the_bytes_are_stale[load-...]`)."""
    outcome = load_after_late_compute(monkeypatch, seed)
    np.testing.assert_array_equal(outcome.got, outcome.want)


def _no_event(self) -> None:
    """`ComputeStream.record` removed: no event, so nothing waits on the compute stream."""
    return None


def _no_wait(self, worker, job_id) -> None:
    """`ComputeStream.wait_job` removed: the compute stream does not wait for the load."""


#: (scenario, the `ComputeStream` method replaced, its replacement) of each negative control.
UNORDERED = [pytest.param(store_after_late_forward, "record", _no_event, id="store-no-event"),
             pytest.param(attention_after_late_load, "wait_job", _no_wait, id="attention-no-wait"),
             pytest.param(load_after_late_compute, "record", _no_event, id="load-no-event")]


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed{s}")
@pytest.mark.parametrize("scenario, method, removed", UNORDERED)
def test_without_the_ordering_the_bytes_are_stale(monkeypatch, scenario, method, removed, seed):
    """Negative control of the three tests above: the same scenario with the connector's
    ordering on the compute stream removed reads exactly the stale bytes, every seed (the held
    copies make the late side run after everything unordered by construction), so those
    tests can fail and would."""
    monkeypatch.setattr(ComputeStream, method, removed)
    outcome = scenario(monkeypatch, seed)
    assert not np.array_equal(outcome.want, outcome.stale)
    np.testing.assert_array_equal(outcome.got, outcome.stale)


@needs_gpu
def test_cuda_store_waits_for_the_forward_on_the_current_stream():
    """As `test_store_holds_the_kv_a_late_forward_wrote`, with `WorkerSide`'s own compute
    stream (torch's current stream, through `torch_stream`): the forward's writes wait behind
    a ~0.5 s delay kernel when the store is issued. Not run without a GPU; without the
    ordering the store would copy the zeros long before the writes run."""
    rank = _rank("cuda")
    new = {name: _random_kv(rank, i).cuda() for i, name in enumerate(LAYERS)}
    torch.cuda.synchronize()
    try:
        torch.cuda._sleep(SLEEP_CYCLES)          # the forward is still running ...
        for name, t in new.items():             # ... when its layers write the KV
            rank.kv[name][_index(SRC_BLOCKS).cuda()] = t
        rank.store(1, SRC_BLOCKS)
        assert rank.ended(1) == 1
        rank.start_load(2, DST_BLOCKS)
        rank.side.wait_for_save(rank.meta())
        torch.cuda.synchronize()
        assert np.array_equal(rank.blocks(DST_BLOCKS),
                              np.concatenate([_bytes(t) for t in new.values()]))
    finally:
        torch.cuda.synchronize()
        rank.close()


@needs_gpu
@pytest.mark.parametrize("layer_waits", [True, False], ids=["layer-waits", "full-graph"])
def test_cuda_attention_on_the_current_stream_reads_the_loaded_kv(layer_waits):
    """As `test_attention_on_the_compute_stream_reads_the_loaded_kv` on torch's current
    stream: a 64 MiB load (256 chunks of 8 heads × 128) takes milliseconds on the load
    stream, while the read of its blocks is queued on the current stream microseconds after
    `wait_for_layer_load` (full-graph: after `start_load_kv` alone, as a full CUDA graph
    replays). Not run without a GPU; without the stream wait the read would see the stale
    bytes of most blocks."""
    num_chunks = 256
    src = np.arange(num_chunks * BLOCKS_PER_CHUNK).reshape(num_chunks, BLOCKS_PER_CHUNK)
    dst = src + src.size
    rank = _rank("cuda", heads=8, head_size=128, num_blocks=2 * src.size)
    try:
        for i, name in enumerate(LAYERS):
            rank.kv[name][_index(src).cuda()] = _random_kv(rank, i, src).cuda()
            rank.kv[name].view(torch.int16)[_index(dst).cuda()] = -1
        torch.cuda.synchronize()
        rank.store(1, src)
        assert rank.ended(1) == num_chunks
        expected = rank.blocks(src)
        rank.start_load(2, dst, layer_waits)
        read = [rank.kv[name][_index(dst).cuda()] for name in LAYERS]   # attention's read
        rank.side.wait_for_save(rank.meta())
        torch.cuda.synchronize()
        assert np.array_equal(np.concatenate([_bytes(r) for r in read]), expected)
    finally:
        torch.cuda.synchronize()
        rank.close()
