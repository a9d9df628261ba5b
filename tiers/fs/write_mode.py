"""Buffered or O_DIRECT writes for large chunks, chosen by measuring both (`o_direct: "adaptive"`).

Which of the two is faster for chunks of `SMALL_CHUNK_BYTES` and more depends on the machine,
not on kvhal (issue 13, `kvhal bench tier` at 2 MiB against vLLM's O_DIRECT tier): buffered
writes measured 1.5-4.9x vLLM on two machines (the page cache takes a burst at memory speed),
and 0.42x on a VM whose page-cache copy runs at 0.34 GB/s (`dd` buffered, where O_DIRECT
wrote 1.3 GB/s; `perf`: 87% in `copy_folio_from_iter_atomic`), where kvhal's O_DIRECT writes
measured 0.97x. No fixed default suits both, so the tier measures its own writes: every large
write's wall seconds per byte feed one running average per mode, the cheaper mode is used, and
the other is still tried now and then (every `EXPLORE_EVERY`-th write while the first
`SETTLE_AFTER` large writes are made, every `EXPLORE_SETTLED`-th after), so a change (the page
cache filling up, other load on the disk) moves the choice back.
"""
from __future__ import annotations

import threading

#: The first writes alternate the modes, this many of each, before any is preferred.
WARMUP_PER_MODE = 2
#: While the first SETTLE_AFTER large writes are made, every EXPLORE_EVERY-th takes the other mode.
EXPLORE_EVERY = 8
SETTLE_AFTER = 64
#: After that, every EXPLORE_SETTLED-th (a slower mode costs this share of writes: under 1%).
EXPLORE_SETTLED = 128
#: Weight of the newest write in a mode's running average of seconds per byte.
SMOOTHING = 0.2


class LargeWriteMode:
    """The running choice between buffered (False) and O_DIRECT (True) large writes. Thread-safe.

    `choose()` before each large write, `record(direct, nbytes, seconds)` after it succeeds.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._writes = 0
        #: Running average wall seconds per byte of each mode; None until measured.
        self._cost: dict[bool, float | None] = {True: None, False: None}

    def choose(self) -> bool:
        """True for an O_DIRECT write, False for a buffered one (see the module docstring)."""
        with self._lock:
            self._writes += 1
            n = self._writes
            if n <= 2 * WARMUP_PER_MODE:
                return n % 2 == 1
            best = self._best()
            period = EXPLORE_EVERY if n <= SETTLE_AFTER else EXPLORE_SETTLED
            return (not best) if n % period == 0 else best

    def record(self, direct: bool, nbytes: int, seconds: float) -> None:
        """Add a finished write of `nbytes` (> 0) that took `seconds` of wall time."""
        cost = max(seconds, 0.0) / nbytes
        with self._lock:
            old = self._cost[direct]
            self._cost[direct] = cost if old is None else old + SMOOTHING * (cost - old)

    def _best(self) -> bool:
        direct, buffered = self._cost[True], self._cost[False]
        if direct is None or buffered is None:  # the measured one; O_DIRECT if neither
            return buffered is None
        return direct <= buffered

    def current(self) -> bool:
        """The mode preferred now, without counting a write: the cheaper one measured (the only
        one measured, or O_DIRECT before any)."""
        with self._lock:
            return self._best()

    def rates(self) -> dict[str, float | None]:
        """Measured GB/s (1e9 bytes per second) of each mode's running average, None until a
        write of that mode finished: {"o_direct": ..., "buffered": ...}."""
        with self._lock:
            return {name: (None if cost is None else (1e-9 / cost if cost else float("inf")))
                    for name, cost in (("o_direct", self._cost[True]),
                                       ("buffered", self._cost[False]))}
