"""The NVRTC copy kernel compiles (no GPU needed to compile; launching needs one)."""
from __future__ import annotations

import pytest

from kvhal.backends.cuda.kernel import compile_cubin
from kvhal.hal import NotSupportedError


@pytest.fixture(scope="module")
def nvrtc():
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-python is not installed")
    try:
        compile_cubin(80)
    except NotSupportedError as exc:
        if "NVRTC unavailable" in str(exc):
            pytest.skip(f"{exc}")
        raise


@pytest.mark.parametrize("arch", [75, 80, 90], ids=lambda a: f"sm_{a}")
def test_kernel_compiles_to_an_elf_cubin(nvrtc, arch):
    cubin = compile_cubin(arch)
    assert cubin[:4] == b"\x7fELF"
    assert b"kvhal_copy_blocks" in cubin


def test_unknown_architecture_is_a_not_supported_error_with_the_log(nvrtc):
    with pytest.raises(NotSupportedError, match="NVRTC failed for sm_1:") as info:
        compile_cubin(1)
    assert info.value.api == "nvrtcCompileProgram"
