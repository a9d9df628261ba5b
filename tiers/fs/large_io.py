"""Buffered or O_DIRECT writes of large chunks, chosen by measuring both (`o_direct:
"adaptive"`, `direct.RULES`).

Which of the two writes chunks of `SMALL_CHUNK_BYTES` and more faster depends on the machine,
not on kvhal: buffered writes land a burst at memory speed and are written back behind it,
unless the machine's page-cache copy is slower than its disk (README "fs tier I/O mode" has
the figures). No fixed default suits both, so the tier measures its own large writes and uses
the faster mode; the other is still tried now and then, so a change (the page cache filling
up, other load on the disk) moves the choice back.

What is measured is throughput, in windows: `WINDOW` writes in a row take one mode, and the
window's cost is the busy seconds (seconds with at least one large write in flight) from its
first write's start to its last one's end, over its bytes. A write's own wall time will not
do: it mostly measures how many others it queued behind (16 in the middle of a burst, 1 at
its end). The first two windows take one mode each; then the other mode gets a window now and
then, at gaps that double while the choice holds (`FIRST_EXPLORE_GAP` to `MAX_EXPLORE_GAP`
windows, longer while the other mode measured much slower, so that its windows cost about
`EXPLORE_OVERHEAD` of the time). The preferred mode changes only when the other is cheaper by
more than `SWITCH_MARGIN`, so two modes within run-to-run noise do not flip.

Reads are not chosen this way (the tier reads large chunks with O_DIRECT): where CPU is
scarce, the CPU and page-cache work of buffered cold reads also slows the O_DIRECT reads in
flight beside them, so neither per-read times nor windows tell the two modes apart, and a
measured choice of read mode lost to always reading with O_DIRECT.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

#: Transfers in a row that take one mode and are measured together.
WINDOW = 16
#: After the first two windows (one of each mode), and after a change of choice, the other
#: mode gets one window this many windows later; each such window doubles the gap to the next
#: one, up to MAX_EXPLORE_GAP (a mode 4x slower then costs under 5%).
FIRST_EXPLORE_GAP = 4
MAX_EXPLORE_GAP = 64
#: A gap may grow past MAX_EXPLORE_GAP while the other mode measured k times slower, up to
#: (k - 1) / EXPLORE_OVERHEAD windows (its windows then cost 1% of the time), at most
#: LONGEST_EXPLORE_GAP: a mode 4x faster than the other would otherwise lose 4.6%.
EXPLORE_OVERHEAD = 0.01
LONGEST_EXPLORE_GAP = 1024
#: Weight of the newest window in the preferred mode's running average of busy seconds per
#: byte (the other mode's newest window replaces its figure).
SMOOTHING = 0.3
#: The preferred mode changes only when the other one's cost is under this fraction of its own.
SWITCH_MARGIN = 0.9


class _Window:
    """`WINDOW` consecutive transfers of one mode: their bytes, and the busy clock from the
    first one's start to the last one's end."""

    __slots__ = ("direct", "begun", "open", "nbytes", "started", "ended")

    def __init__(self, direct: bool, started: float) -> None:
        self.direct, self.started, self.ended = direct, started, started
        self.begun = self.open = self.nbytes = 0


@dataclass(frozen=True, slots=True)
class LargeTransfer:
    """One large transfer under way: its mode (`direct`: O_DIRECT, else buffered) and the
    window it is measured in."""

    direct: bool
    window: _Window


class LargeIoMode:
    """The running choice between buffered and O_DIRECT for the large writes of one tier (the
    class knows transfers, not their direction). Thread-safe.

    `begin()` before each large transfer; `end(transfer, nbytes)` once after it, with the bytes
    moved, or with None if it failed (its time still counts, its bytes do not; a window whose
    transfers all failed leaves its mode unmeasured, so the other one is preferred).

    Args:
        clock: Wall clock in seconds (`time.perf_counter`; a test passes its own).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        #: Running average busy seconds per byte of each mode; None until measured.
        self._cost: dict[bool, float | None] = {True: None, False: None}
        #: The preferred mode (O_DIRECT until one is measured).
        self._preferred = True
        self._windows = 0
        self._gap = FIRST_EXPLORE_GAP
        self._next_explore = 2 + FIRST_EXPLORE_GAP
        self._window: _Window | None = None
        self._in_flight = 0
        #: Seconds with a transfer in flight since this object was made.
        self._busy = 0.0
        self._last = clock()

    def _advance(self) -> None:
        now = self._clock()
        if self._in_flight:
            self._busy += max(now - self._last, 0.0)
        self._last = now

    def _next_mode(self) -> bool:
        n = self._windows
        if n <= 2:
            return n == 1
        if n < self._next_explore:
            return self._preferred
        self._gap = min(2 * self._gap, self._longest_gap())
        self._next_explore = n + self._gap
        return not self._preferred

    def _longest_gap(self) -> int:
        mine, other = self._cost[self._preferred], self._cost[not self._preferred]
        if mine is None or other is None:
            return MAX_EXPLORE_GAP
        slower = other / mine - 1.0
        return max(MAX_EXPLORE_GAP, min(round(slower / EXPLORE_OVERHEAD), LONGEST_EXPLORE_GAP))

    def begin(self) -> LargeTransfer:
        """Choose the mode of the next large transfer (module docstring) and count it in
        flight until `end`."""
        with self._lock:
            self._advance()
            window = self._window
            if window is None or window.begun == WINDOW:
                self._windows += 1
                window = self._window = _Window(self._next_mode(), self._busy)
            window.begun += 1
            window.open += 1
            self._in_flight += 1
            return LargeTransfer(window.direct, window)

    def end(self, transfer: LargeTransfer, nbytes: int | None) -> None:
        """End `transfer` (from `begin`, once): it moved `nbytes` (> 0), or failed (None)."""
        with self._lock:
            self._advance()
            self._in_flight -= 1
            window = transfer.window
            window.open -= 1
            window.nbytes += nbytes or 0
            window.ended = self._busy
            if window.open == 0 and window.begun == WINDOW:
                self._measured(window)

    def _measured(self, window: _Window) -> None:
        if not window.nbytes:   # every transfer failed: the mode has no figure until one works
            self._cost[window.direct] = None
        else:
            cost = max(window.ended - window.started, 1e-9) / window.nbytes
            old = self._cost[window.direct]
            # the other mode's windows are rare: its newest one stands for it
            weight = SMOOTHING if window.direct is self._preferred else 1.0
            self._cost[window.direct] = cost if old is None else old + weight * (cost - old)
        direct, buffered = self._cost[True], self._cost[False]
        if direct is None or buffered is None:  # the measured one
            self._preferred = buffered is None
            return
        mine, other = (direct, buffered) if self._preferred else (buffered, direct)
        if other < SWITCH_MARGIN * mine:
            self._preferred = not self._preferred
            self._gap = FIRST_EXPLORE_GAP
            self._next_explore = self._windows + FIRST_EXPLORE_GAP

    def current(self) -> bool:
        """The mode preferred now (True: O_DIRECT), without counting a transfer."""
        with self._lock:
            return self._preferred

    def rates(self) -> dict[str, float | None]:
        """Each mode's measured throughput in GB/s (1e9 bytes per busy second, a running
        average over its windows), None until a window of that mode was measured:
        {"o_direct": ..., "buffered": ...}."""
        with self._lock:
            return {name: None if cost is None else 1e-9 / cost
                    for name, cost in (("o_direct", self._cost[True]),
                                       ("buffered", self._cost[False]))}
