"""Vendor error codes map onto the kvhal.hal error hierarchy."""
from __future__ import annotations

import pytest

from kvhal.backends._runtime import Errors
from kvhal.backends.cuda.table import CUDA
from kvhal.backends.rocm.table import ROCM
from kvhal.hal import (BackendUnavailableError, DeviceFaultError, HalError, InvalidValueError,
                       NotSupportedError, OutOfMemoryError)

# (vendor, code, expected class); codes from cudaError_t (cuda-python 13.4) and hipError_t
# (hip-python 10.0).
CASES = [("cuda", 2, OutOfMemoryError), ("cuda", 1, InvalidValueError),
         ("cuda", 101, InvalidValueError), ("cuda", 712, InvalidValueError),
         ("cuda", 801, NotSupportedError), ("cuda", 35, BackendUnavailableError),
         ("cuda", 100, BackendUnavailableError), ("cuda", 700, DeviceFaultError),
         ("cuda", 214, DeviceFaultError), ("cuda", 719, DeviceFaultError),
         ("rocm", 2, OutOfMemoryError), ("rocm", 1, InvalidValueError),
         ("rocm", 400, InvalidValueError), ("rocm", 713, InvalidValueError),
         ("rocm", 801, NotSupportedError), ("rocm", 35, BackendUnavailableError),
         ("rocm", 100, BackendUnavailableError), ("rocm", 700, DeviceFaultError),
         ("rocm", 214, DeviceFaultError), ("rocm", 702, DeviceFaultError)]


@pytest.mark.parametrize("vendor,code,cls", CASES, ids=lambda p: str(getattr(p, "__name__", p)))
def test_vendor_code_maps_to_hal_class(request, vendor, code, cls):
    table, rt = {"cuda": (CUDA, "cuda_rt"), "rocm": (ROCM, "hip_rt")}[vendor]
    module = request.getfixturevalue(rt)
    errors = Errors(table, getattr(module, table.error_enum()))
    err = errors.error(code, "memcpy")
    assert type(err) is cls
    assert (err.backend, err.code, err.api) == (vendor, code, "memcpy")


def test_unlisted_code_is_plain_hal_error(cuda_rt):
    errors = Errors(CUDA, cuda_rt.cudaError_t)
    err = errors.error(999, "cudaMalloc")
    assert type(err) is HalError
    assert str(err) == "[cuda] cudaMalloc failed: cudaErrorUnknown (api=cudaMalloc, code=999)"


def test_code_outside_the_enum_is_named_unknown(cuda_rt):
    errors = Errors(CUDA, cuda_rt.cudaError_t)
    assert str(errors.error(123456, "cudaFree")) == \
        "[cuda] cudaFree failed: unknown error 123456 (api=cudaFree, code=123456)"


def test_not_ready_is_not_mapped_to_an_error_class(cuda_rt, hip_rt):
    assert Errors(CUDA, cuda_rt.cudaError_t).not_ready == 600
    assert 600 not in Errors(CUDA, cuda_rt.cudaError_t).classes
    assert 600 not in Errors(ROCM, hip_rt.hipError_t).classes


def test_check_unwraps_result_tuples(cuda_rt):
    errors = Errors(CUDA, cuda_rt.cudaError_t)
    ok = cuda_rt.cudaError_t.cudaSuccess
    assert errors.check((ok,), "a") is None
    assert errors.check((ok, 7), "a") == 7
    assert errors.check((ok, 7, 8), "a") == (7, 8)


def test_check_raises_on_a_real_runtime_failure(cuda_no_driver):
    errors = Errors(CUDA, cuda_no_driver.cudaError_t)
    with pytest.raises(BackendUnavailableError) as info:
        errors.check(cuda_no_driver.cudaGetDeviceCount(), "cudaGetDeviceCount")
    assert (info.value.code, info.value.api) == (35, "cudaGetDeviceCount")
