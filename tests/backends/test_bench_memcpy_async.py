"""`kvhal bench copy`'s plain-`cudaMemcpyAsync` baseline, where no GPU is: the plumbing on the
cpu backend, the cuda loop's error path without a driver, and the verb's one-line refusal.
On a GPU (`scripts/gpu_check.sh`) `kvhal bench copy --backend cuda` prints the figures."""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from kvhal.backends.cpu import CpuBackend
from kvhal.integrations.harness.bench.copy import measure, memcpy_async_baseline


def test_no_baseline_off_cuda():
    assert memcpy_async_baseline(CpuBackend()) is None


def test_a_baseline_is_timed_on_the_same_buffers_and_gives_ratios():
    backend = CpuBackend()
    calls = []

    def one_copy_per_block(dsts, srcs, sizes, stream):
        calls.append(len(sizes))
        for dst, src, nbytes in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
            backend.copy_async(dst, src, nbytes, stream)

    result = measure(backend, 4096, repeats=1, baseline=one_copy_per_block)
    assert calls == [1000] * 4          # D2H and H2D: a warm-up and a timed pass each
    assert result.memcpy_async_d2h_gbps > 0 and result.memcpy_async_h2d_gbps > 0
    assert result.d2h_vs_memcpy_async == result.d2h_gbps / result.memcpy_async_d2h_gbps
    assert result.h2d_vs_memcpy_async == result.h2d_gbps / result.memcpy_async_h2d_gbps


def test_without_a_baseline_the_ratios_are_none():
    result = measure(CpuBackend(), 4096, repeats=1)
    assert (result.memcpy_async_d2h_gbps, result.d2h_vs_memcpy_async) == (None, None)


def test_the_cuda_loop_raises_the_runtimes_error_without_a_driver(cuda_no_driver):
    copy = memcpy_async_baseline(SimpleNamespace(name="cuda"))
    one = np.array([16], dtype=np.uint64)
    with pytest.raises(RuntimeError, match=r"^cudaMemcpyAsync\(16 bytes\) returned "
                                           r"cudaErrorInsufficientDriver \(35\)$"):
        copy(one, one, one, SimpleNamespace(handle=0))


def test_bench_copy_on_cuda_without_a_driver_exits_with_the_reason_in_one_line(cuda_no_driver):
    out = subprocess.run([sys.executable, "-m", "kvhal.cli", "bench", "copy", "--backend",
                          "cuda", "--sizes", "4KiB", "--json"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.count("\n") == 1
    assert out.stderr.startswith("kvhal bench: error: [cuda] backend 'cuda' is unavailable: "
                                 "cudaGetDeviceCount returned cudaErrorInsufficientDriver")


def test_the_table_shows_the_baseline_and_its_ratios_beside_kvhals(monkeypatch, capsys):
    import argparse

    from kvhal.integrations.harness.bench import copy as bench

    def one_copy_per_block(backend):
        def copy(dsts, srcs, sizes, stream):
            for dst, src, nbytes in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
                backend.copy_async(dst, src, nbytes, stream)
        return copy

    monkeypatch.setattr(bench, "memcpy_async_baseline", one_copy_per_block)
    assert bench.run(argparse.Namespace(backend="cpu", sizes=[4096], repeats=1, json=False)) == 0
    out = capsys.readouterr().out
    assert "kvhal ÷ one cudaMemcpyAsync per block" in out
    assert "D2H ÷ async" in out and "H2D ÷ async" in out
