"""`test_strided`'s round trips on a real NVIDIA GPU: vLLM 0.33's six memory orders and kernel
blocks as CUDA tensor views, stored and loaded by kvhal's engine `Worker` on the cuda backend
(pinned host slot, `cudaMemcpy2DAsync`/batch copies). Skips without torch-with-CUDA and a GPU
(run by `scripts/gpu_check.sh`)."""
from __future__ import annotations

import numpy as np
import pytest

from kvhal.layout import PageStrides, chunk_mapper, device_cache, rank_share, strided_layout

from .test_strided import CASES, ORDERS, chunk_case

torch = pytest.importorskip("torch", reason="torch is not installed")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device visible to torch", allow_module_level=True)


@pytest.fixture(scope="module")
def backend():
    from kvhal import plugins
    try:
        b = plugins.select_backend("cuda")
    except Exception as exc:  # noqa: BLE001 - BackendUnavailableError, missing binding
        pytest.skip(f"kvhal's cuda backend is unavailable: {exc}")
    return b


@pytest.mark.parametrize("order,kind,tp,kt", CASES, ids=lambda p: str(getattr(p, "value", p)))
def test_cuda_store_then_load_is_canonical_and_exact(backend, order, kind, tp, kt):
    from kvhal.backends._runtime.interop import tensor_allocation
    from kvhal.engine import Worker
    from kvhal.hal import host_array

    block, nblocks, per_chunk = 8, 6, 2
    spec, logical, chunk_ids, want = chunk_case(kind)
    group = spec.groups[0]
    row = group.row_bytes
    chunk = chunk_ids[None]
    host = backend.alloc_pinned(want.size)
    host_array(host)[:] = 0
    ranks = []
    for rank in range(tp):
        share = rank_share(group, tp, rank)
        ratio = block // kt
        shape = (2, nblocks * ratio, share.num_heads, kt, row)
        strides, step = [0] * 5, 1
        for dim in reversed(ORDERS[order]):
            strides[dim] = step
            step *= shape[dim]
        buf = torch.zeros(step, dtype=torch.uint8, device="cuda")
        full = torch.as_strided(buf, shape, strides)
        views = [full[i] for i in range(2)]
        for layer, v in enumerate(views):
            mine = logical[layer][:, share.first_head:share.first_head + share.num_heads]
            v.copy_(torch.from_numpy(mine.reshape(nblocks, share.num_heads, ratio, kt, row)
                                     .transpose(0, 2, 1, 3, 4).reshape(shape[1:]).copy()))
        sb = [s for s in views[0].stride()]
        layout = strided_layout(PageStrides(kt, sb[0] if ratio > 1 else 0, sb[1], sb[2]))
        mapper = chunk_mapper(spec, layout, tp, rank, per_chunk)
        device = device_cache(mapper, views)
        torch.cuda.synchronize()
        alloc = tensor_allocation(backend, buf)

        def planner(ids, addr, direction, mapper=mapper, device=device):
            from kvhal.layout import plan_copies
            return plan_copies(mapper, ids, device, addr, direction.value)

        worker = Worker(backend, planner, host_ptr=host.ptr, slot_bytes=host.nbytes)
        worker.submit_store(1, chunk, np.array([0]))
        worker.wait()
        assert [r.ok for r in worker.get_finished()] == [True]
        ranks.append((views, share, worker, alloc, buf))
    np.testing.assert_array_equal(host_array(host), want)
    for views, share, worker, alloc, buf in ranks:
        buf.zero_()
        torch.cuda.synchronize()
        worker.submit_load(2, chunk, np.array([0]))
        worker.wait()
        assert [r.ok for r in worker.get_finished()] == [True]
        for layer, v in enumerate(views):
            got = v.cpu().numpy().reshape(nblocks, ratio, share.num_heads, kt, row)
            got = got.transpose(0, 2, 1, 3, 4).reshape(nblocks, share.num_heads, block, row)
            mine = logical[layer][:, share.first_head:share.first_head + share.num_heads]
            np.testing.assert_array_equal(got[chunk[0]], mine[chunk[0]])
        worker.close()
        backend.free(alloc)
    backend.free(host)
