"""Every runtime call the cuda and rocm backends make is accepted by the real bindings.

Without a driver the CUDA runtime still parses each call's arguments and then returns error 35
(cudaErrorInsufficientDriver); hip-python converts every argument and then raises RuntimeError
because libamdhip64.so is missing. So an argument a binding rejects shows up here as a
TypeError, and a well-formed call as that vendor's no-runtime failure. The backend is configured
with chosen runtime/driver versions (`_configure`) instead of the ones the missing driver
reports; that is what selects the batch path under test.
"""
from __future__ import annotations

import mmap
import sys

import numpy as np
import pytest

from kvhal.backends.cuda import CudaBackend
from kvhal.backends.rocm import RocmBackend
from kvhal.hal import (Allocation, BackendUnavailableError, Event, InvalidValueError,
                       MemoryKind, Stream)

DEVICE_PTR, HOST_PTR = 1 << 40, 1 << 41


def configured(runtime_version: int = 13040, driver_version: int = 13040,
               cls: type = CudaBackend):
    backend = cls.__new__(cls)
    backend._bind()
    backend._configure(device_count=1, runtime_version=runtime_version,
                       driver_version=driver_version, device=0)
    return backend


@pytest.fixture
def cuda(cuda_no_driver):
    """A cuda backend bound to the real binding, with one device and one pinned range known."""
    backend = configured()
    return with_ranges(backend)


def with_ranges(backend):
    backend._track(Allocation(DEVICE_PTR, 1 << 20, MemoryKind.DEVICE, 0, backend.name))
    backend._track(Allocation(HOST_PTR, 1 << 20, MemoryKind.PINNED, -1, backend.name))
    return backend


@pytest.fixture
def rocm(hip_rt):
    """A rocm backend bound to hip-python, HIP 7.2 reported, without libamdhip64 loadable."""
    try:
        hip_rt.hipGetDeviceCount()
    except RuntimeError:
        return with_ranges(configured(70_200_000, 70_200_000, RocmBackend))
    pytest.skip("a HIP runtime is present; these tests pin the no-runtime behaviour")


def stream(backend, handle: int = 0x1234) -> Stream:
    """A live stream of `backend` by raw handle (as torch's streams are handed over)."""
    return backend.external_stream(handle, 0)


def event(backend, handle: int, timing: bool = True) -> Event:
    """An event object `backend` treats as live, without the runtime call that would fail."""
    backend._live_events.add(handle)
    return Event(backend.name, timing, getattr(backend._rt, backend.table.prefix + "Event_t")(
        handle))


#: A real read-write host buffer, so register_host gets past its mapping check.
HOST_BUFFER = np.zeros(1 << 16, dtype=np.uint8)


def api_of(call) -> str:
    with pytest.raises(BackendUnavailableError) as info:
        call()
    assert info.value.code == 35
    return info.value.api


def test_each_operation_reaches_its_runtime_call(cuda, cuda_no_driver):
    s = stream(cuda)
    calls = {
        "cudaMemcpyAsync": lambda: cuda.copy_async(DEVICE_PTR, HOST_PTR, 4096, s),
        "cudaMemcpy2DAsync": lambda: cuda.copy_2d_async(DEVICE_PTR, 256, HOST_PTR, 512, 128,
                                                        16, s),
        "cudaMemcpy2DAsync (batch)": lambda: cuda.copy_2d_batch_async(
            np.array([[DEVICE_PTR, 256, HOST_PTR, 512, 128, 16]], np.uint64), s),
        "cudaHostAlloc": lambda: cuda.alloc_pinned(4096),
        "cudaHostRegister": lambda: cuda.register_host(HOST_BUFFER.ctypes.data, 4096),
        "cudaStreamQuery": lambda: cuda.stream_query(s),
        "cudaStreamSynchronize": lambda: cuda.stream_synchronize(s),
        "cudaStreamWaitEvent": lambda: cuda.stream_wait_event(s, event(cuda, 5)),
        "cudaEventRecord": lambda: cuda.record_event(event(cuda, 5), s),
        "cudaEventQuery": lambda: cuda.event_query(event(cuda, 5)),
        "cudaEventSynchronize": lambda: cuda.event_synchronize(event(cuda, 5)),
        "cudaEventElapsedTime": lambda: cuda.event_elapsed_ms(event(cuda, 5), event(cuda, 6)),
        "cudaEventDestroy": lambda: cuda.destroy_event(event(cuda, 5)),
        "cudaSetDevice": lambda: cuda.create_stream(),
    }
    assert {api: api_of(call) for api, call in calls.items()} == \
        {api: api.split()[0] for api in calls}


def test_each_rocm_operation_passes_hip_python_argument_conversion(rocm, hip_rt):
    s = stream(rocm)
    ev, ev2 = event(rocm, 5), event(rocm, 6)
    calls = [lambda: rocm.copy_async(DEVICE_PTR, HOST_PTR, 4096, s),
             lambda: rocm.copy_2d_async(DEVICE_PTR, 256, HOST_PTR, 512, 128, 16, s),
             lambda: rocm.copy_batch_async([DEVICE_PTR], [HOST_PTR], [64], s),
             lambda: rocm.copy_2d_batch_async([[DEVICE_PTR, 256, HOST_PTR, 512, 128, 16]], s),
             lambda: rocm.alloc_pinned(4096),
             lambda: rocm.register_host(HOST_BUFFER.ctypes.data, 4096),
             lambda: rocm.stream_query(s), lambda: rocm.stream_synchronize(s),
             lambda: rocm.stream_wait_event(s, ev), lambda: rocm.record_event(ev, s),
             lambda: rocm.event_query(ev), lambda: rocm.event_synchronize(ev),
             lambda: rocm.event_elapsed_ms(ev, ev2), lambda: rocm.destroy_event(ev),
             lambda: rocm.create_stream(), lambda: rocm.create_event(True)]
    for call in calls:
        with pytest.raises(RuntimeError, match="libamdhip64.so"):
            call()


def test_rocm_without_library_symbol_loops(rocm):
    caps = rocm.capabilities()
    assert caps.native_batch is False
    assert caps.notes == ("runtime 7.2, driver 7.2",
                          "hipMemcpyBatchAsync not found in libamdhip64.so; per-copy loop")


def test_native_batch_is_one_call_with_attributes(cuda, cuda_no_driver):
    sizes = np.full(3, 100, dtype=np.uint64)
    offsets = np.arange(3, dtype=np.uint64) * np.uint64(4096)
    with pytest.raises(BackendUnavailableError) as info:
        cuda.copy_batch_async(DEVICE_PTR + offsets, HOST_PTR + offsets, sizes,
                              stream(cuda))
    assert info.value.api == "cudaMemcpyBatchAsync"
    assert "batch of 3 copies" in str(info.value)


def test_old_runtime_batch_loops_over_memcpy(cuda_no_driver):
    backend = configured(runtime_version=12060, driver_version=12060)
    backend._track(Allocation(DEVICE_PTR, 4096, MemoryKind.DEVICE, 0, "cuda"))
    assert backend.capabilities().native_batch is False
    assert api_of(lambda: backend.copy_batch_async([DEVICE_PTR], [DEVICE_PTR + 2048], [64],
                                                   stream(backend))) == "cudaMemcpyAsync"


def test_legacy_default_stream_batch_loops_over_memcpy(cuda, cuda_no_driver):
    legacy = cuda.external_stream(0, 0)
    assert api_of(lambda: cuda.copy_batch_async([DEVICE_PTR], [HOST_PTR], [64], legacy)) == \
        "cudaMemcpyAsync"


def test_register_failure_leaves_nothing_registered(cuda):
    with pytest.raises(BackendUnavailableError):
        cuda.register_host(HOST_BUFFER.ctypes.data, 4096)
    with pytest.raises(InvalidValueError, match="outside every allocation"):
        cuda.copy_async(DEVICE_PTR, 1 << 42, 16, stream(cuda))


@pytest.mark.parametrize("dst,src,nbytes,match", [
    (DEVICE_PTR, HOST_PTR + (1 << 20) - 8, 16, "src range"),
    (DEVICE_PTR - 1, HOST_PTR, 16, "dst range"),
    (DEVICE_PTR, HOST_PTR, -1, r"nbytes must be in \[0, 2\*\*64\)"),
], ids=["src-past-end", "dst-before-start", "negative"])
def test_bad_ranges_are_refused_before_any_call(cuda, dst, src, nbytes, match):
    with pytest.raises(InvalidValueError, match=match):
        cuda.copy_async(dst, src, nbytes, stream(cuda))


def test_batch_arrays_of_different_lengths_are_refused(cuda):
    with pytest.raises(InvalidValueError, match="dsts=2 srcs=1 sizes=1"):
        cuda.copy_batch_async([DEVICE_PTR, DEVICE_PTR], [HOST_PTR], [8], stream(cuda))


def test_2d_pitch_smaller_than_width_is_refused(cuda):
    with pytest.raises(InvalidValueError, match="src_pitch 64 < width 128"):
        cuda.copy_2d_async(DEVICE_PTR, 256, HOST_PTR, 64, 128, 4, stream(cuda))


def test_2d_batch_is_checked_whole_before_any_call(cuda):
    """The second row's src range is bad: nothing reaches the runtime (no no-driver error)."""
    rows = np.array([[DEVICE_PTR, 256, HOST_PTR, 512, 128, 16],
                     [DEVICE_PTR, 256, HOST_PTR + (1 << 20), 512, 128, 16]], np.uint64)
    with pytest.raises(InvalidValueError, match=r"copies row 1: src range") as info:
        cuda.copy_2d_batch_async(rows, stream(cuda))
    assert (info.value.arg, info.value.index) == ("copies", 1)


def test_zero_sized_copies_make_no_call(cuda):
    s = stream(cuda)
    cuda.copy_async(DEVICE_PTR, HOST_PTR, 0, s)
    cuda.copy_2d_async(DEVICE_PTR, 256, HOST_PTR, 256, 0, 4, s)
    cuda.copy_2d_batch_async(np.array([[DEVICE_PTR, 256, HOST_PTR, 256, 0, 4]], np.uint64), s)
    cuda.copy_2d_batch_async(np.empty((0, 6), np.uint64), s)
    cuda.copy_batch_async(np.array([DEVICE_PTR], np.uint64), np.array([HOST_PTR], np.uint64),
                          np.zeros(1, np.uint64), s)


def test_foreign_stream_is_refused(cuda):
    with pytest.raises(InvalidValueError, match="not a live cuda stream"):
        cuda.stream_query(Stream("cpu", 0, None))


def test_event_without_timing_is_refused_before_the_call(cuda, cuda_no_driver):
    plain = event(cuda, 5, timing=False)
    with pytest.raises(InvalidValueError, match="start event was created without timing"):
        cuda.event_elapsed_ms(plain, event(cuda, 6))


def test_free_of_unknown_allocation_is_refused(cuda):
    with pytest.raises(InvalidValueError, match="double free"):
        cuda.free(Allocation(DEVICE_PTR + 64, 64, MemoryKind.DEVICE, 0, "cuda"))


def test_adopted_device_memory_is_forgotten_not_freed(cuda):
    adopted = cuda.adopt_device(1 << 43, 8192, 0)
    cuda.free(adopted)  # no cudaFree: it would fail with error 35 here
    with pytest.raises(InvalidValueError, match="double free"):
        cuda.free(adopted)


def test_capabilities_name_versions_and_batch_path(cuda):
    caps = cuda.capabilities()
    assert (caps.native_batch, caps.max_batch_descriptors, caps.device_count) == (True, 8192, 1)
    assert caps.notes[:2] == ("runtime 13.4, driver 13.4",
                              "native cudaMemcpyBatchAsync, 8192 descriptors per call")
    assert caps.notes[2].startswith(("copy kernel selectable per transfer "
                                     "(copy_batch_kernel_async), NVRTC 13.", "copy kernel off: "))


def test_capabilities_say_kernel_off_when_nvrtc_does_not_import(cuda, monkeypatch):
    monkeypatch.delattr(sys.modules["cuda.bindings"], "nvrtc", raising=False)
    monkeypatch.setitem(sys.modules, "cuda.bindings.nvrtc", None)  # the import system refuses
    assert cuda.capabilities().notes[2] == (
        "copy kernel off: NVRTC unavailable (ModuleNotFoundError); install kvhal's 'cuda-nvrtc' "
        "extra")


def test_kernel_batch_validates_before_compiling(cuda):
    with pytest.raises(InvalidValueError, match="dsts\\[0\\] range"):
        cuda.copy_batch_kernel_async([1 << 44], [HOST_PTR], [16], stream(cuda))


def test_unknown_device_is_refused(cuda):
    with pytest.raises(InvalidValueError, match="device 1 does not exist"):
        cuda.alloc_device(4096, 1)


@pytest.mark.parametrize("value", [None, "64", 64.0, True, 1 << 64, -1], ids=repr)
@pytest.mark.parametrize("arg", ["dst", "src", "nbytes"])
def test_non_int_copy_arguments_are_refused_before_any_call(cuda, arg, value):
    args = {"dst": DEVICE_PTR, "src": HOST_PTR, "nbytes": 64} | {arg: value}
    with pytest.raises(InvalidValueError, match=arg):
        cuda.copy_async(args["dst"], args["src"], args["nbytes"], stream(cuda))


@pytest.mark.parametrize("device", [7, -1, 0.0, "0"], ids=repr)
def test_bad_device_arguments_are_refused(cuda, device):
    with pytest.raises(InvalidValueError, match="device"):
        cuda.create_stream(device)


def test_destroyed_stream_is_refused_afterwards(cuda):
    own = Stream("cuda", 0, cuda.external_stream(0x99, 0).handle)
    cuda._live_streams[0x99] = False  # as if create_stream had made it
    assert api_of(lambda: cuda.destroy_stream(own)) == "cudaStreamSynchronize"
    with pytest.raises(InvalidValueError, match="not a live cuda stream"):
        cuda.copy_async(DEVICE_PTR, HOST_PTR, 16, own)


def test_external_stream_cannot_be_destroyed(cuda):
    with pytest.raises(InvalidValueError, match="created elsewhere"):
        cuda.destroy_stream(stream(cuda))


def test_destroyed_event_is_refused_afterwards(cuda):
    ev = event(cuda, 5)
    assert api_of(lambda: cuda.destroy_event(ev)) == "cudaEventDestroy"
    with pytest.raises(InvalidValueError, match="not a live cuda event"):
        cuda.event_query(ev)


def test_register_host_refuses_read_only_memory(cuda):
    ro = mmap.mmap(-1, 1 << 16, prot=mmap.PROT_READ)
    ptr = np.frombuffer(ro, dtype=np.uint8).ctypes.data
    with pytest.raises(InvalidValueError, match="not mapped read-write"):
        cuda.register_host(ptr, 1 << 16)


def test_free_refuses_what_is_not_an_allocation(cuda):
    with pytest.raises(InvalidValueError, match="expected an Allocation"):
        cuda.free(42)
