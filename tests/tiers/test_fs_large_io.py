"""`o_direct: "adaptive"`: the choice between buffered and O_DIRECT large transfers follows the
throughput measured in windows of each mode (busy seconds per byte), keeps trying the other
mode at growing gaps, and does not flip on a difference within `SWITCH_MARGIN`."""
from __future__ import annotations

import threading

import pytest

from kvhal.tiers.fs.large_io import (EXPLORE_OVERHEAD, FIRST_EXPLORE_GAP, LONGEST_EXPLORE_GAP,
                                       MAX_EXPLORE_GAP, SWITCH_MARGIN, WINDOW, LargeIoMode)

MiB = 1 << 20


class ManualClock:
    """A clock the test advances: the `time.perf_counter` of `LargeIoMode(clock=...)`."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _windows(mode: LargeIoMode, clock: ManualClock, windows: int,
             seconds: dict[bool, float]) -> list[bool]:
    """Run `windows` windows of 1 MiB transfers one after another, each taking
    `seconds[mode]`; the mode of each window."""
    chosen = []
    for _ in range(windows):
        modes = set()
        for _ in range(WINDOW):
            transfer = mode.begin()
            clock.now += seconds[transfer.direct]
            mode.end(transfer, MiB)
            modes.add(transfer.direct)
        assert len(modes) == 1           # a window takes one mode
        chosen.append(modes.pop())
    return chosen


def _explorations(first: int, count: int, longest: int = MAX_EXPLORE_GAP) -> list[int]:
    """Window numbers (1-based) of the other mode while the choice holds: gaps doubling from
    FIRST_EXPLORE_GAP to `longest` after `first`."""
    numbers, n, gap = [], first, FIRST_EXPLORE_GAP
    while len(numbers) < count:
        n += gap
        numbers.append(n)
        gap = min(2 * gap, longest)
    return numbers


def _longest(slower: float) -> int:
    """The longest gap while the other mode measures `slower` times the preferred one's cost."""
    return max(MAX_EXPLORE_GAP, min(round((slower - 1) / EXPLORE_OVERHEAD), LONGEST_EXPLORE_GAP))


def test_one_window_of_each_then_the_faster_mode_with_explorations_at_doubling_gaps():
    clock = ManualClock()
    mode = LargeIoMode(clock)
    chosen = _windows(mode, clock, 300, {True: 0.001, False: 0.003})

    assert chosen[:2] == [True, False]
    explored = [n for n, direct in enumerate(chosen, start=1) if not direct and n > 2]
    assert explored == _explorations(2, len(explored), _longest(3.0))
    assert explored[:6] == [6, 14, 30, 62, 126, 254]
    assert mode.current() is True
    rates = mode.rates()
    assert rates["o_direct"] == pytest.approx(MiB / 0.001 / 1e9)
    assert rates["buffered"] == pytest.approx(MiB / 0.003 / 1e9)


def test_a_much_slower_mode_is_tried_rarely_enough_to_cost_about_one_percent():
    clock = ManualClock()
    mode = LargeIoMode(clock)
    chosen = _windows(mode, clock, 2500, {True: 0.001, False: 0.005})

    explored = [n for n, direct in enumerate(chosen, start=1) if not direct and n > 2]
    gaps = [b - a for a, b in zip(explored, explored[1:])]
    assert gaps[-1] == _longest(5.0) == 400
    overhead = len(explored[-3:]) * 4.0 / (explored[-1] - explored[-4])   # extra time per window
    assert overhead <= 1.05 * EXPLORE_OVERHEAD


def test_the_choice_moves_when_the_costs_change_and_the_gap_starts_again():
    clock = ManualClock()
    mode = LargeIoMode(clock)
    _windows(mode, clock, 20, {True: 0.001, False: 0.003})
    assert mode.current() is True
    # buffered gets cheap (say the disk is busy with other writes): the next exploration sees it
    chosen = _windows(mode, clock, 2 * MAX_EXPLORE_GAP, {True: 0.004, False: 0.0005})

    assert mode.current() is False
    flipped = 20 + chosen.index(False)            # the window at whose end it moved
    rest = chosen[flipped - 20:]
    explored = [n for n, direct in enumerate(rest, start=flipped + 1) if direct]
    assert explored == _explorations(flipped, len(explored))


def test_a_difference_within_the_margin_does_not_flip_the_choice():
    clock = ManualClock()
    mode = LargeIoMode(clock)
    _windows(mode, clock, 20, {True: 0.001, False: 0.003})
    near = 0.001 * (SWITCH_MARGIN + (1 - SWITCH_MARGIN) / 2)
    chosen = _windows(mode, clock, 200, {True: 0.001, False: near})
    assert mode.current() is True
    assert chosen.count(False) >= 3
    _windows(mode, clock, 200, {True: 0.001, False: 0.001 * SWITCH_MARGIN * 0.8})
    assert mode.current() is False


def test_a_window_costs_its_busy_seconds_not_the_sum_of_its_transfers_wall_times():
    """16 transfers in flight together for 2 s move 16 MiB in 2 busy seconds (8 MiB/s), not 32
    transfer-seconds; an idle second between windows is not counted."""
    clock = ManualClock()
    mode = LargeIoMode(clock)
    burst = [mode.begin() for _ in range(WINDOW)]
    assert {t.direct for t in burst} == {True}
    clock.now += 2.0
    for transfer in burst:
        mode.end(transfer, MiB)
    clock.now += 1.0                              # idle
    second = [mode.begin() for _ in range(WINDOW)]
    assert {t.direct for t in second} == {False}
    clock.now += 4.0
    for transfer in second:
        mode.end(transfer, MiB)

    assert mode.rates() == {"o_direct": pytest.approx(WINDOW * MiB / 2.0 / 1e9),
                            "buffered": pytest.approx(WINDOW * MiB / 4.0 / 1e9)}
    assert mode.current() is True
    assert mode._in_flight == 0


def test_a_mode_whose_transfers_always_fail_is_never_preferred():
    clock = ManualClock()
    mode = LargeIoMode(clock)
    assert mode.rates() == {"o_direct": None, "buffered": None}
    assert mode.current() is True  # O_DIRECT before anything is measured
    chosen = []
    for _ in range(40 * WINDOW):
        transfer = mode.begin()
        clock.now += 0.002
        mode.end(transfer, None if transfer.direct else MiB)  # every O_DIRECT one fails
        chosen.append(transfer.direct)

    assert mode.rates()["o_direct"] is None
    assert mode.current() is False
    # window 1, then explorations at doubling gaps from window 2
    assert chosen.count(True) == WINDOW * (1 + len([n for n in _explorations(2, 10) if n <= 40]))
    assert mode._in_flight == 0


def test_a_preferred_mode_that_starts_failing_gives_way_to_the_other():
    clock = ManualClock()
    mode = LargeIoMode(clock)
    _windows(mode, clock, 20, {True: 0.001, False: 0.00105})
    assert mode.current() is True
    failed = 0
    for _ in range(2 * WINDOW):          # from now on every O_DIRECT transfer fails
        transfer = mode.begin()
        clock.now += 0.001
        mode.end(transfer, None if transfer.direct else MiB)
        failed += transfer.direct
    assert failed == WINDOW              # one window of failures, then buffered
    assert mode.current() is False
    assert mode.rates()["o_direct"] is None


def test_a_window_of_no_elapsed_time_gives_a_finite_rate():
    mode = LargeIoMode(lambda: 1.0)      # a clock that does not move
    for _ in range(2 * WINDOW):
        mode.end(mode.begin(), MiB)
    rates = mode.rates()
    assert all(rate is not None and rate < float("inf") for rate in rates.values()), rates


def test_concurrent_transfers_are_all_counted_and_ended():
    mode = LargeIoMode()

    def mover():
        for _ in range(500):
            mode.end(mode.begin(), MiB)
    threads = [threading.Thread(target=mover) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert mode._windows == 8 * 500 // WINDOW
    assert mode._in_flight == 0
    assert all(rate is not None and rate > 0 for rate in mode.rates().values())
