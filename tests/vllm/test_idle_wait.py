"""`IdleWait`: a step with nothing to compute while an asynchronous load is in
flight waits, longer for each such step in a row, and briefly again once work resumes.

Seen failing with the old fixed wait (`time.sleep(IDLE_WAIT_S)` every idle step): the waits were
[0.0005] * 7, which let one decode leg waiting on its prefiller run ~2,700 engine steps a second
and starve a prefiller sharing the machine's 2 cores (tests/vllm/test_pd_server.py's concurrent
legs, cached 0 in a full run).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="the scheduler side imports vLLM (the `vllm` extra)")

from kvhal.integrations.vllm.scheduler import side as scheduler  # noqa: E402
from kvhal.integrations.vllm.scheduler import (  # noqa: E402
    IDLE_WAIT_MAX_S, IDLE_WAIT_S, IdleWait, SchedulerSide)


@pytest.fixture
def waits(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(scheduler.time, "sleep", slept.append)
    return slept


def test_idle_steps_in_a_row_wait_twice_as_long_up_to_the_cap(waits):
    idle = IdleWait()
    for _ in range(7):
        idle.after_step(0, waiting=True)
    assert waits == [IDLE_WAIT_S * 2 ** i for i in range(5)] + [IDLE_WAIT_MAX_S] * 2
    assert IDLE_WAIT_S * 2 ** 4 == IDLE_WAIT_MAX_S


def test_a_step_that_computes_starts_the_waits_over(waits):
    idle = IdleWait()
    for tokens in (0, 0, 0, 5, 0):
        idle.after_step(tokens, waiting=True)
    assert waits == [IDLE_WAIT_S, 2 * IDLE_WAIT_S, 4 * IDLE_WAIT_S, IDLE_WAIT_S]


def test_no_wait_without_a_load_in_flight(waits):
    idle = IdleWait()
    idle.idle_steps = 3
    idle.after_step(0, waiting=False)
    assert waits == [] and idle.idle_steps == 0


def test_a_lookup_a_tier_is_still_deciding_waits_too():
    """A request whose last lookup was deferred (a tier asking a peer) and nothing else in
    flight: the idle steps wait as for a transfer. Seen failing without `deciding` in the
    condition: no wait at all (`[] == [0.0005, 0.001]`)."""
    side = SimpleNamespace(lookup=SimpleNamespace(deciding={"r"}),
                           loads=SimpleNamespace(in_flight=lambda: False),
                           _pending=lambda: False)
    assert SchedulerSide._waiting(side)
    side.lookup.deciding.clear()
    assert not SchedulerSide._waiting(side)


def test_steps_kept_for_pending_tier_work_wait_too():
    """With no request, vLLM steps while the connector has pending push work (a tier job in
    flight, events untaken: `has_pending_push_work`); those steps wait as for a transfer, so an
    idle engine does not spin a core for them. Fails without that term in `_waiting`."""
    pending = [True]
    side = SimpleNamespace(lookup=SimpleNamespace(deciding=set()),
                           loads=SimpleNamespace(in_flight=lambda: False),
                           _pending=lambda: pending[0])
    assert SchedulerSide._waiting(side)
    pending[0] = False
    assert not SchedulerSide._waiting(side)
    manager = SimpleNamespace(has_pending_work=lambda: False)
    jobs: list = []
    side = SimpleNamespace(jobs=jobs, manager=manager, _stop_signalled=False)
    side._pending = lambda: SchedulerSide._pending(side)
    assert not SchedulerSide.has_pending_push_work(side)
    jobs.append("a host job on the workers")
    assert SchedulerSide.has_pending_push_work(side)
    side = SimpleNamespace(jobs=[], manager=SimpleNamespace(has_pending_work=lambda: True),
                           _stop_signalled=False)
    side._pending = lambda: SchedulerSide._pending(side)
    assert SchedulerSide.has_pending_push_work(side)
