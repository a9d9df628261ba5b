"""Copies ordered against torch's current CUDA stream, without vLLM (what `scripts/gpu_check.sh`
runs on a GPU machine that has torch but no vLLM): a store waits for a late forward through
`ComputeStream.record`, attention waits for a load through `ComputeStream.wait_job`. The
vLLM-side twins are `tests/vllm/test_compute_ordering.py::test_cuda_*`; the cpu-backend proofs
with negative controls are there and in `test_worker.py`. Skips without a GPU."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device visible to torch", allow_module_level=True)

from kvhal import plugins  # noqa: E402
from kvhal.backends._runtime.interop import tensor_allocation  # noqa: E402
from kvhal.engine import Worker  # noqa: E402
from kvhal.hal import host_array  # noqa: E402
from kvhal.integrations.vllm.compute import ComputeStream, torch_stream  # noqa: E402
from kvhal.layout import attention_spec, chunk_mapper, device_cache, plan_copies  # noqa: E402

#: `torch.cuda._sleep` cycles ahead of the forward's writes: about 0.5 s at 2 GHz.
SLEEP_CYCLES = 1 << 30
HEADS, TOKENS, HEAD_SIZE, BLOCKS = 8, 16, 128, 64


@pytest.fixture
def rig():
    backend = plugins.select_backend("cuda")
    spec = attention_spec(num_layers=1, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype="fp16",
                          block_size=TOKENS)
    mapper = chunk_mapper(spec, "packed-hnd", 1, 0, BLOCKS // 2)
    kv = torch.zeros((BLOCKS, HEADS, TOKENS, 2 * HEAD_SIZE), dtype=torch.float16, device="cuda")
    device = device_cache(mapper, [kv])
    alloc = tensor_allocation(backend, kv)
    host = backend.alloc_pinned(mapper.chunk.chunk_bytes)
    worker = Worker(backend, lambda ids, addr, d: plan_copies(mapper, ids, device, addr, d.value),
                    host_ptr=host.ptr, slot_bytes=host.nbytes)
    compute = ComputeStream(backend, lambda: torch_stream(backend))
    yield kv, host, worker, compute
    worker.close()
    compute.close()
    backend.free(alloc)
    backend.free(host)


def test_store_waits_for_the_late_forward_on_the_current_stream(rig):
    kv, host, worker, compute = rig
    new = torch.randn(kv.shape, device="cuda").half()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)          # the forward is still running ...
    kv.copy_(new)                             # ... when it writes the KV
    worker.submit_store(1, np.arange(BLOCKS // 2)[None], np.array([0]), after=compute.record())
    worker.wait()
    assert [r.ok for r in worker.get_finished()] == [True]
    torch.cuda.synchronize()
    want = new[:BLOCKS // 2].cpu().contiguous().view(torch.uint8).numpy().ravel()
    np.testing.assert_array_equal(host_array(host), want)   # packed-hnd, TP 1: the same bytes


def test_attention_on_the_current_stream_reads_the_loaded_kv(rig):
    kv, host, worker, compute = rig
    host_array(host)[:] = np.random.default_rng(0).integers(0, 256, host.nbytes, np.uint8)
    kv.fill_(-1)
    torch.cuda.synchronize()
    worker.submit_load(1, np.arange(BLOCKS // 2, BLOCKS)[None], np.array([0]))
    compute.wait_job(worker, 1)              # queued on the current stream; the host goes on
    read = kv[BLOCKS // 2:].clone()          # attention's read, on the current stream
    torch.cuda.synchronize()
    worker.wait()
    assert [r.ok for r in worker.get_finished()] == [True]
    np.testing.assert_array_equal(read.cpu().contiguous().view(torch.uint8).numpy().ravel(),
                                  host_array(host))
