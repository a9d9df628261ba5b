"""Validation of the numeric keys of tier configs, one home for every tier that parses them
(fs, obj, p2p, mooncake)."""
from __future__ import annotations

import math
from typing import Any, Mapping

from kvhal.tier import TierError


def number(cfg: Mapping[str, Any], name: str, default: float, lo: float, hi: float, *,
           integer: bool = False, zero_ok: bool = False) -> Any:
    """`cfg[name]` (or `default`), checked to be a number in [lo, hi] (or 0 with `zero_ok`).

    Args:
        integer: Accept ints only (bool is never a number here).

    Raises:
        TierError: "NAME: must be a number in [lo, hi], got VALUE" (an integer with
            `integer`; "or 0" with `zero_ok`), for a value of another type, NaN, an infinity
            or out of range, ints of any size included.
    """
    value = cfg.get(name, default)
    kinds = (int,) if integer else (int, float)
    if (not isinstance(value, kinds) or isinstance(value, bool)
            or (isinstance(value, float) and not math.isfinite(value))
            or not (lo <= value <= hi or (zero_ok and value == 0))):
        what = "an integer" if integer else "a number"
        zero = " or 0" if zero_ok else ""
        shown = repr(value)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        raise TierError(f"{name}: must be {what} in [{lo}, {hi}]{zero}, got {shown}")
    return value


def positive_int(cfg: Mapping[str, Any], name: str, default: int | None) -> int | None:
    """`cfg[name]`, an int > 0 (bool is not one), or `default` (None allowed) when absent.

    Raises:
        TierError: "NAME: must be a positive integer, got VALUE".
    """
    value = cfg.get(name, default)
    if value is default:
        return value
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise TierError(f"{name}: must be a positive integer, got {value!r}")
    return value


def seconds(cfg: Mapping[str, Any], name: str, default: float, most: float) -> float:
    """`cfg[name]` (or `default`) as float seconds in (0, `most`].

    Raises:
        TierError: "NAME: must be a number of seconds in (0, MOST], got VALUE" (NaN and
            infinities included).
    """
    value = cfg.get(name, default)
    if (not isinstance(value, (int, float)) or isinstance(value, bool)
            or not 0 < value <= most):
        raise TierError(f"{name}: must be a number of seconds in (0, {most}], got {value!r}")
    return float(value)
