"""Key prefixes of the tiers that keep chunks as named objects (obj, mooncake): one home for
their syntax, importable without any tier's extra.

A prefix is "/"-separated segments of the characters S3 object keys take safely (AWS "Object
key naming guidelines": letters, digits and !_.*'()=+,;@~-), none "." or "..".
"""
from __future__ import annotations

import re
from typing import Any

from kvhal.tier import TierError

_SEGMENT_RE = re.compile(r"^[A-Za-z0-9!_.*'()=+,;@~-]+$")


def normalize_prefix(value: Any) -> str:
    """`value` without surrounding "/", checked segment by segment.

    Raises:
        TierError: not a string, or a bad segment.
    """
    if not isinstance(value, str):
        raise TierError(f"prefix: must be a string, got {value!r}")
    prefix = value.strip("/")
    if prefix and not all(_SEGMENT_RE.match(s) and s not in (".", "..")
                          for s in prefix.split("/")):
        raise TierError(f"prefix: segments between \"/\" must be non-empty, not \".\" or "
                        f"\"..\", of letters, digits and !_.*'()=+,;@~-; got {value!r}")
    return prefix
