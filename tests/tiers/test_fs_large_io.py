"""`o_direct: "adaptive"`: the choice between buffered and O_DIRECT large transfers follows the
measured cost of each, and keeps trying the other."""
from __future__ import annotations

import threading

from kvhal.tiers.fs.large_io import (EXPLORE_EVERY, EXPLORE_SETTLED, SETTLE_AFTER,
                                       WARMUP_PER_MODE, LargeIoMode)

MiB = 1 << 20


def _run(mode: LargeIoMode, writes: int, seconds: dict[bool, float]) -> list[bool]:
    """Make `writes` writes of 1 MiB, each mode taking `seconds[mode]`; the modes chosen."""
    chosen = []
    for _ in range(writes):
        direct = mode.choose()
        mode.record(direct, MiB, seconds[direct])
        chosen.append(direct)
    return chosen


def test_warm_up_alternates_then_the_cheaper_mode_wins_with_exploration():
    mode = LargeIoMode()
    chosen = _run(mode, 200, {True: 0.001, False: 0.003})

    warm = 2 * WARMUP_PER_MODE
    assert chosen[:warm] == [True, False] * WARMUP_PER_MODE
    for n, direct in enumerate(chosen[warm:], start=warm + 1):
        period = EXPLORE_EVERY if n <= SETTLE_AFTER else EXPLORE_SETTLED
        assert direct is (n % period != 0), n
    assert mode.current() is True
    rates = mode.rates()
    assert abs(rates["o_direct"] - MiB / 0.001 / 1e9) < 1e-9
    assert abs(rates["buffered"] - MiB / 0.003 / 1e9) < 1e-9


def test_the_choice_moves_when_the_costs_change():
    mode = LargeIoMode()
    _run(mode, 64, {True: 0.001, False: 0.003})
    assert mode.current() is True
    # buffered gets cheap (say the disk is busy with other writes): the explorations see it
    chosen = _run(mode, 3 * EXPLORE_SETTLED, {True: 0.004, False: 0.0005})

    assert mode.current() is False
    assert chosen[-EXPLORE_SETTLED // 2:].count(False) >= EXPLORE_SETTLED // 2 - 1


def test_a_mode_whose_writes_never_finish_is_not_preferred():
    mode = LargeIoMode()
    assert mode.rates() == {"o_direct": None, "buffered": None}
    assert mode.current() is True  # O_DIRECT before anything is measured
    chosen = []
    for _ in range(40):
        direct = mode.choose()
        if not direct:  # every O_DIRECT write fails: never recorded
            mode.record(direct, MiB, 0.002)
        chosen.append(direct)

    assert mode.rates()["o_direct"] is None
    assert mode.current() is False
    assert chosen[2 * WARMUP_PER_MODE:].count(True) <= 40 // EXPLORE_EVERY


def test_concurrent_writers_count_every_write():
    mode = LargeIoMode()

    def writer():
        _run(mode, 500, {True: 0.001, False: 0.002})
    threads = [threading.Thread(target=writer) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert mode._count == 4000
    assert mode.current() is True
