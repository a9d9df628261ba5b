"""Fixtures for the cuda/rocm backend tests that need no device."""
from __future__ import annotations

import pytest

from kvhal.backends._runtime.probe import import_binding
from kvhal.backends.cuda.table import CUDA
from kvhal.backends.rocm.table import ROCM


def binding(table):
    """The vendor binding module, or a skip naming the missing extra."""
    try:
        return import_binding(table)
    except ImportError as exc:
        pytest.skip(f"{table.package} not installed ({exc}); install kvhal's "
                    f"{table.extra!r} extra")


@pytest.fixture
def cuda_rt():
    """cuda-python's `cuda.bindings.runtime`."""
    return binding(CUDA)


@pytest.fixture
def hip_rt():
    """hip-python's `hip.hip`."""
    return binding(ROCM)


@pytest.fixture
def cuda_no_driver(cuda_rt):
    """Skip unless this machine has cuda-python but no usable NVIDIA driver (the CPU CI case)."""
    err, _ = cuda_rt.cudaGetDeviceCount()
    if int(err) == 0:
        pytest.skip("an NVIDIA driver is present; these tests pin the no-driver behaviour")
    return cuda_rt
