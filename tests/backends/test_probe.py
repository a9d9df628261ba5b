"""Without a device both backends import, register, and say exactly why they cannot run."""
from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest

from kvhal import doctor, plugins
from kvhal.backends._runtime import probe
from kvhal.backends.cuda import CudaBackend
from kvhal.backends.cuda.table import CUDA
from kvhal.backends.rocm import RocmBackend
from kvhal.hal import BackendUnavailableError

CUDA_NO_DRIVER = ("cudaGetDeviceCount returned cudaErrorInsufficientDriver (35): CUDA driver "
                  "version is insufficient for CUDA runtime version; runtime ")


def test_cuda_without_driver_reports_error_35(cuda_no_driver):
    availability = CudaBackend.probe()
    assert availability.available is False
    assert availability.reason.startswith(CUDA_NO_DRIVER)
    assert availability.reason.endswith(", driver none")


def test_rocm_without_library_reports_the_dlopen_failure(hip_rt):
    availability = RocmBackend.probe()
    if availability.available:
        pytest.skip("a HIP runtime is present")
    assert availability.reason.startswith("hipGetDeviceCount raised RuntimeError: ")
    assert "libamdhip64.so" in availability.reason
    assert "b'" not in availability.reason  # hip-python's bytes reprs are unwrapped


def test_missing_binding_names_the_extra():
    table = dataclasses.replace(CUDA, module="kvhal_no_such_binding.runtime")
    availability = probe(table)
    assert availability.available is False
    assert availability.reason == (
        "cuda-python (cuda.bindings.runtime) is not importable (ModuleNotFoundError: No module "
        "named 'kvhal_no_such_binding'); install kvhal's 'cuda' extra")


def test_missing_attribute_of_binding_package_is_a_reason():
    table = dataclasses.replace(CUDA, module="json:no_such_attribute")
    assert probe(table).reason.startswith("cuda-python (cuda.bindings.runtime) is not "
                                          "importable (ImportError: json has no attribute")


@pytest.mark.parametrize("cls", [CudaBackend, RocmBackend], ids=lambda c: c.name)
def test_construction_raises_with_the_probe_reason(cls):
    availability = cls.probe()
    if availability.available:
        pytest.skip(f"{cls.name} is available here")
    assert cls.is_available() is False
    with pytest.raises(BackendUnavailableError) as info:
        cls()
    assert str(info.value) == f"[{cls.name}] {availability.reason}"


def test_doctor_lists_both_with_their_reasons():
    rows = {r["name"]: r for r in doctor.collect()}
    for name in ("cuda", "rocm"):
        spec = plugins.backend_spec(name)
        expected = spec.cls.probe()
        assert rows[name]["available"] is expected.available
        assert rows[name]["reason"] == expected.reason


def test_conformance_skips_unavailable_backends_with_their_reason():
    if CudaBackend.is_available() or RocmBackend.is_available():
        pytest.skip("a device backend is available here")
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "conformance/test_hal_memory.py", "-q", "-rs",
         "-p", "no:cacheprovider", "-p", "no:xdist", "--kvhal-backend=cuda",
         "--kvhal-backend=rocm"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"backend cuda unavailable: {CudaBackend.probe().reason}" in out.stdout
    assert f"backend rocm unavailable: {RocmBackend.probe().reason}" in out.stdout
    assert re.fullmatch(r"\d+ skipped in [\d.]+s", out.stdout.strip().splitlines()[-1])
