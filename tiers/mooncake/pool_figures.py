"""The pool's fill as its master reports it: `mooncake_master` serves Prometheus text on its
`-metrics_port` (`/metrics`: `master_allocated_bytes`, `master_total_capacity_bytes`, over all
mounted segments). `PoolFigures` reads them on a thread of its own every `interval_s`, so the
tier's `pool_used_bytes` / `pool_capacity_bytes` gauges cost nothing when exported.
"""
from __future__ import annotations

import logging
import threading
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

#: The master's gauges read → this module's names.
FIGURES = {"master_allocated_bytes": "used", "master_total_capacity_bytes": "capacity"}


class PoolFigures:
    """Polls `url` (the master's `/metrics`) every `interval_s` seconds (first read at once).

    Attributes:
        used, capacity: Bytes allocated in / mountable by the pool at the last read (0 before
            one succeeded; the last good read stays after a failed one, which is logged once).
    """

    def __init__(self, url: str, interval_s: float, timeout_s: float = 2.0):
        self.url, self.used, self.capacity = url, 0.0, 0.0
        self._interval_s, self._timeout_s = interval_s, timeout_s
        self._stop = threading.Event()
        self._failing = False
        self._thread = threading.Thread(target=self._run, name="kvhal-mooncake-pool",
                                        daemon=True)
        self._thread.start()

    def read(self) -> None:
        """Read the master's figures now (logs, never raises, when it cannot)."""
        try:
            with urllib.request.urlopen(self.url, timeout=self._timeout_s) as reply:
                text = reply.read().decode()
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name in FIGURES:
                        setattr(self, FIGURES[sample.name], sample.value)
            self._failing = False
        except (OSError, ValueError) as exc:
            if not self._failing:
                log.warning("mooncake tier: cannot read the master's metrics at %s (%s); the "
                            "pool gauges keep their last values", self.url, exc)
            self._failing = True

    def _run(self) -> None:
        while True:
            self.read()
            if self._stop.wait(self._interval_s):
                return

    def close(self) -> None:
        """Stop polling."""
        self._stop.set()
        self._thread.join(timeout=self._timeout_s + 1)
