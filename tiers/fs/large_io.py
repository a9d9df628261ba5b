"""Buffered or O_DIRECT I/O for large chunks, chosen by measuring both (`o_direct: "adaptive"`).

Which of the two is faster for chunks of `SMALL_CHUNK_BYTES` and more depends on the machine,
not on kvhal (issue 13, `kvhal bench tier` at 2 MiB against vLLM's O_DIRECT tier): buffered
writes measured 1.5-4.9x vLLM and buffered reads 1.1-1.7x on two machines (the page cache
takes a burst of writes at memory speed; read-ahead keeps the disk busy), and on a VM whose
page-cache copy runs at 0.34 GB/s (`dd` buffered, where O_DIRECT wrote 1.3 GB/s; `perf`: 87%
in `copy_folio_from_iter_atomic`) buffered writes measured 0.42x and buffered reads 0.78x,
where kvhal's O_DIRECT writes and reads measured 0.97-0.99x. No fixed default suits both, so
the tier measures its own large writes and reads, each direction on its own: every one's wall
seconds per byte feed a running average per mode, the cheaper mode is used, and the other is
still tried now and then (every `EXPLORE_EVERY`-th while the first `SETTLE_AFTER` are made,
every `EXPLORE_SETTLED`-th after), so a change (the page cache filling up, other load on the
disk) moves the choice back. A buffered read served from the page cache counts as the cheap
read it is.
"""
from __future__ import annotations

import threading

#: The first transfers alternate the modes, this many of each, before any is preferred.
WARMUP_PER_MODE = 2
#: While the first SETTLE_AFTER are made, every EXPLORE_EVERY-th takes the other mode.
EXPLORE_EVERY = 8
SETTLE_AFTER = 64
#: After that, every EXPLORE_SETTLED-th (a slower mode costs this share: under 1%).
EXPLORE_SETTLED = 128
#: Weight of the newest transfer in a mode's running average of seconds per byte.
SMOOTHING = 0.2


class LargeIoMode:
    """The running choice between buffered (False) and O_DIRECT (True) for one direction (large
    writes or large reads) of one tier. Thread-safe.

    `choose()` before each large transfer, `record(direct, nbytes, seconds)` after it succeeds.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        #: Running average wall seconds per byte of each mode; None until measured.
        self._cost: dict[bool, float | None] = {True: None, False: None}

    def choose(self) -> bool:
        """True for an O_DIRECT transfer, False for a buffered one (module docstring)."""
        with self._lock:
            self._count += 1
            n = self._count
            if n <= 2 * WARMUP_PER_MODE:
                return n % 2 == 1
            best = self._best()
            period = EXPLORE_EVERY if n <= SETTLE_AFTER else EXPLORE_SETTLED
            return (not best) if n % period == 0 else best

    def record(self, direct: bool, nbytes: int, seconds: float) -> None:
        """Add a finished transfer of `nbytes` (> 0) that took `seconds` of wall time."""
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
        """The mode preferred now, without counting a transfer: the cheaper one measured (the
        only one measured, or O_DIRECT before any)."""
        with self._lock:
            return self._best()

    def rates(self) -> dict[str, float | None]:
        """Measured GB/s (1e9 bytes per second) of each mode's running average, None until a
        transfer of that mode finished: {"o_direct": ..., "buffered": ...}. A rate per
        transfer (its bytes over its own wall time, with the tier's other transfers in
        flight), not the tier's throughput."""
        with self._lock:
            return {name: (None if cost is None else (1e-9 / cost if cost else float("inf")))
                    for name, cost in (("o_direct", self._cost[True]),
                                       ("buffered", self._cost[False]))}
