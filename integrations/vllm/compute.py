"""The engine's compute stream, as the connector orders its copies against it (DESIGN §5).

vLLM queues a step's forward pass on torch's current stream (CUDA, and ROCm through the same
`torch.cuda` API), so when the connector is called the layers may not have run yet: a store
must wait on an event recorded there after the layers that wrote its KV, and attention must
wait for a load's copies before it reads the blocks. vLLM-CPU runs the forward on the host,
synchronously: there is no stream, the KV is written whenever the connector is called, and a
load is waited for by blocking the host.
"""
from __future__ import annotations

from typing import Callable

from kvhal.engine import Worker
from kvhal.hal import DeviceBackend, Event, Stream


class ComputeStream:
    """Orders kvhal's copies against the forward pass.

    Args:
        backend: The HAL backend of the KV tensors (the engine workers' backend).
        current: Returns the stream the forward runs on at the time of the call (vLLM may
            switch streams between steps), a stream of `backend`; None: the forward runs on
            the host and has finished whenever the connector is called (vLLM-CPU).

    Threading: one thread (the connector's, in the vLLM worker process) calls every method.
    """

    def __init__(self, backend: DeviceBackend, current: Callable[[], Stream] | None):
        self.backend = backend
        self.current = current
        self._event = backend.create_event() if current is not None else None

    def record(self) -> Event | None:
        """An event after everything queued on the compute stream so far (e.g. the layers
        that wrote this step's KV), for `Worker.submit_store(after=...)`; None without a
        stream (the KV is complete). Each call re-records the same event: hand it to stream
        waits before the next call (a wait binds the record current when it is queued, as
        `cudaStreamWaitEvent` does)."""
        if self._event is None:
            return None
        self.backend.record_event(self._event, self.current())
        return self._event

    @property
    def streamed(self) -> bool:
        """True where the forward runs on a stream (`wait_job` queues a wait and returns at
        once); False on vLLM-CPU (`wait_job` blocks the host)."""
        return self.current is not None

    def wait_job(self, worker: Worker, job_id: int) -> None:
        """Make the forward's later work (attention) run after the copies of `worker`'s job
        `job_id`: a wait queued on the compute stream (the host does not block), or, without a
        stream, block the host until the job has ended (its result stays queued)."""
        if self.current is None:
            worker.wait(job_id)
        else:
            worker.stream_wait_job(self.current(), job_id)

    def close(self) -> None:
        """Release the event (the streams belong to the engine)."""
        if self._event is not None:
            self.backend.destroy_event(self._event)
            self._event = None


def torch_stream(backend: DeviceBackend) -> Stream:
    """torch's current accelerator stream as a HAL `Stream` of `backend` (cuda, rocm: their
    `external_stream(handle, device)`); torch keeps ownership: never `destroy_stream` it."""
    import torch

    stream = torch.cuda.current_stream()
    return backend.external_stream(int(stream.cuda_stream), int(stream.device.index or 0))


def compute_stream(backend: DeviceBackend) -> ComputeStream:
    """The compute stream of vLLM's forward for KV tensors on `backend`: torch's current stream
    on cuda and rocm (`torch_stream`), none on cpu (vLLM-CPU)."""
    if backend.name == "cpu":
        return ComputeStream(backend, None)
    return ComputeStream(backend, lambda: torch_stream(backend))
