"""Placeholder for the rocm backend until its implementation lands (issue 8)."""
from __future__ import annotations

from typing import ClassVar

from kvhal.hal import Availability, BackendUnavailableError


class RocmBackend:
    """The rocm `DeviceBackend`; not implemented yet, so it always reports unavailable."""

    name: ClassVar[str] = "rocm"

    @classmethod
    def probe(cls) -> Availability:
        """Never raises."""
        return Availability(False, "the rocm backend is not implemented yet")

    @classmethod
    def is_available(cls) -> bool:
        """`probe().available`."""
        return cls.probe().available

    def __init__(self, **_: object):
        raise BackendUnavailableError(self.probe().reason, backend=self.name)
