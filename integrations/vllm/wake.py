"""Wake vLLM's idle engine core, so that what a tier learns by listing its store leaves as events.

vLLM publishes a connector's KV events only from an engine step, and an engine core with no
request and nothing the connector waits for (`has_pending_push_work`) blocks on its input queue
(`EngineCoreProc._process_input_queue`). A change no step of this instance causes (another
instance evicted a chunk file of a shared fs folder, a bucket lost objects, the Mooncake pool
evicted) is learned by the tier's own listing thread (`SecondaryTier.watch`); without a wake-up
its `BlockRemoved` waits for the next request, and a router keeps crediting an idle instance
with KV that is gone (`kvhal soak` found such claims standing past their bound after the load
stopped). vLLM has a sentinel for exactly this: `EngineCoreRequestType.WAKEUP` on the input
queue wakes the blocked `get`, is otherwise ignored, and the loop then asks
`has_pending_push_work` again (true until the step's `poll` collected the change), steps once
and publishes.

The queue belongs to the `EngineCoreProc` whose `__init__` builds the scheduler and with it
this connector: `engine_waker` finds it on the call stack at that moment (vLLM 0.32 to 0.34
make `input_queue` before the scheduler). An engine stepped in-process by its caller (the
`LLM` class without multiprocessing, tests' `EngineCore`) has no such queue and needs no wake:
its caller steps it.
"""
from __future__ import annotations

import queue
import sys
from typing import Callable


def engine_waker() -> Callable[[], None] | None:
    """A function that wakes the engine core process building the caller, or None when the
    caller is not built inside an `EngineCoreProc` (or this vLLM has no WAKEUP sentinel).
    Call it while the connector is constructed; the function it returns may be called from
    any thread and never blocks."""
    try:
        from vllm.v1.engine import EngineCoreRequestType
        from vllm.v1.engine.core import EngineCoreProc
    except ImportError:
        return None
    wakeup = getattr(EngineCoreRequestType, "WAKEUP", None)
    if wakeup is None:
        return None
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, EngineCoreProc):
            inbox = getattr(owner, "input_queue", None)
            if not isinstance(inbox, queue.Queue):
                return None
            return lambda: inbox.put_nowait((wakeup, None))
        frame = frame.f_back
    return None
