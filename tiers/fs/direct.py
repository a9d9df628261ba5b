"""Which chunk file transfers of the fs tier use O_DIRECT: the `o_direct` config value's rule.

Each value of `o_direct` is one row of `RULES`: for each direction (write = store, read = load)
and size (small: payload below `SMALL_CHUNK_BYTES`; large: the rest) it says BUFFERED (through
the page cache), DIRECT (O_DIRECT) or MEASURED (each large write takes the mode `LargeIoMode`
measured faster lately, `large_io.py`):

    o_direct        small write  small read  large write  large read
    "adaptive"      DIRECT       DIRECT      MEASURED     DIRECT
    "small"         DIRECT       DIRECT      BUFFERED     BUFFERED
    "small-writes"  DIRECT       BUFFERED    BUFFERED     BUFFERED
    "auto", true    DIRECT       DIRECT      DIRECT       DIRECT
    false           BUFFERED     BUFFERED    BUFFERED     BUFFERED

On a filesystem without O_DIRECT every value takes the row of false (the tier refuses to start
under true instead). A transfer whose host bytes are not `ALIGN`-aligned is always buffered:
O_DIRECT moves the payload straight between the host slot and the disk. `DirectIo.way` is the
one place this is decided.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from ..base import JobKind
from .large_io import LargeIoMode, LargeTransfer

#: Payloads below this many bytes are small chunks: between the 256 KiB chunks that O_DIRECT
#: moved faster both ways and the 2 MiB ones that buffered writes did on most machines
#: (README "fs tier I/O mode").
SMALL_CHUNK_BYTES = 1 << 20


class Way(enum.Enum):
    """How one chunk file transfer moves its bytes."""

    BUFFERED = "buffered"
    DIRECT = "o_direct"
    MEASURED = "measured"


@dataclass(frozen=True, slots=True)
class Rule:
    """The `Way` of each (direction, size) class of transfer under one `o_direct` value."""

    small_write: Way
    small_read: Way
    large_write: Way
    large_read: Way


_B, _D, _M = Way.BUFFERED, Way.DIRECT, Way.MEASURED
#: `o_direct` value → its rule (see the module docstring's table); `config.py` accepts these
#: values and no others.
RULES: dict[str | bool, Rule] = {
    "adaptive": Rule(_D, _D, _M, _D),
    "small": Rule(_D, _D, _B, _B),
    "small-writes": Rule(_D, _B, _B, _B),
    "auto": Rule(_D, _D, _D, _D),
    True: Rule(_D, _D, _D, _D),
    False: Rule(_B, _B, _B, _B),
}


@dataclass(frozen=True, slots=True)
class Transfer:
    """The mode of one chunk file transfer: `direct` (O_DIRECT, else buffered) and, for a
    MEASURED one, the `LargeTransfer` its `LargeIoMode` counts in flight until `DirectIo.end`."""

    direct: bool
    measured: LargeTransfer | None = None


_BUFFERED, _DIRECT = Transfer(False), Transfer(True)


class DirectIo:
    """The O_DIRECT rule of one fs tier, and the measurement its MEASURED writes take their
    mode from. Thread-safe.

    Args:
        o_direct: The validated `o_direct` config value (a key of `RULES`).
        supported: Whether the filesystem takes O_DIRECT (`fileio.probe_o_direct`).

    Attributes:
        rule: The rule in force (false's where O_DIRECT is not supported).
        every: Every aligned transfer uses O_DIRECT ("auto" or true, where supported).
        writes_below, reads_below: Payloads below this many bytes are written / read with
            O_DIRECT when not `every` (0: none); larger ones are decided by `rule`.
        large_writes: The measurement of MEASURED writes, or None if the rule has none.
    """

    def __init__(self, o_direct: str | bool, supported: bool) -> None:
        rule = self.rule = RULES[o_direct] if supported else RULES[False]
        ways = (rule.small_write, rule.small_read, rule.large_write, rule.large_read)
        self.every = all(way is _D for way in ways)
        self.writes_below = SMALL_CHUNK_BYTES if rule.small_write is _D and not self.every else 0
        self.reads_below = SMALL_CHUNK_BYTES if rule.small_read is _D and not self.every else 0
        self.large_writes = LargeIoMode() if _M in ways else None

    def way(self, kind: JobKind, nbytes: int, aligned: bool = True) -> Way:
        """The `Way` of a `kind` (STORE or LOAD) transfer of `nbytes` payload bytes whose host
        bytes are `ALIGN`-aligned or not."""
        if not aligned:
            return _B
        rule = self.rule
        if nbytes < SMALL_CHUNK_BYTES:
            return rule.small_write if kind is JobKind.STORE else rule.small_read
        return rule.large_write if kind is JobKind.STORE else rule.large_read

    def direct(self, kind: JobKind, nbytes: int, aligned: bool = True) -> bool:
        """Whether such a transfer uses O_DIRECT now (a MEASURED one: the mode preferred now,
        without counting a transfer)."""
        way = self.way(kind, nbytes, aligned)
        return way is _D or way is _M and self.large_writes.current()

    def begin(self, kind: JobKind, nbytes: int, aligned: bool) -> Transfer:
        """The mode of a transfer about to start; a MEASURED one is counted in flight until
        `end`."""
        way = self.way(kind, nbytes, aligned)
        if way is not _M:
            return _DIRECT if way is _D else _BUFFERED
        measured = self.large_writes.begin()
        return Transfer(measured.direct, measured)

    def end(self, transfer: Transfer, nbytes: int | None) -> None:
        """End `transfer` (from `begin`): a MEASURED one moved `nbytes`, or failed (None)."""
        if transfer.measured is not None:
            self.large_writes.end(transfer.measured, nbytes)
