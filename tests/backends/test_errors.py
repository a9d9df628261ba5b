"""Vendor error codes map onto the kvhal.hal error hierarchy."""
from __future__ import annotations

import pytest

from kvhal.backends._runtime import Errors
from kvhal.backends.cuda.table import CUDA
from kvhal.backends.rocm.table import ROCM
from kvhal.hal import (BackendUnavailableError, DeviceFaultError, HalError, InvalidValueError,
                       NotSupportedError, OutOfMemoryError)

# (code, expected class) per vendor; codes from cudaError_t (cuda-python 13.4) and hipError_t
# (hip-python 10.0).
CUDA_CASES = [(2, OutOfMemoryError), (1, InvalidValueError), (101, InvalidValueError),
              (712, InvalidValueError), (801, NotSupportedError),
              (35, BackendUnavailableError), (100, BackendUnavailableError),
              (700, DeviceFaultError), (214, DeviceFaultError), (719, DeviceFaultError)]
HIP_CASES = [(2, OutOfMemoryError), (1, InvalidValueError), (400, InvalidValueError),
             (713, InvalidValueError), (801, NotSupportedError),
             (35, BackendUnavailableError), (100, BackendUnavailableError),
             (700, DeviceFaultError), (214, DeviceFaultError), (702, DeviceFaultError)]


@pytest.mark.parametrize("code,cls", CUDA_CASES, ids=lambda p: str(getattr(p, "__name__", p)))
def test_cuda_code_maps_to_hal_class(cuda_rt, code, cls):
    errors = Errors(CUDA, cuda_rt.cudaError_t)
    err = errors.error(code, "cudaMemcpyAsync")
    assert type(err) is cls
    assert (err.backend, err.code, err.api) == ("cuda", code, "cudaMemcpyAsync")


@pytest.mark.parametrize("code,cls", HIP_CASES, ids=lambda p: str(getattr(p, "__name__", p)))
def test_hip_code_maps_to_hal_class(hip_rt, code, cls):
    errors = Errors(ROCM, hip_rt.hipError_t)
    err = errors.error(code, "hipMemcpyAsync")
    assert type(err) is cls
    assert (err.backend, err.code, err.api) == ("rocm", code, "hipMemcpyAsync")


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
