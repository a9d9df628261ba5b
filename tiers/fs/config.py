"""Config of the fs tier: one entry of `secondary_tiers` with `"type": "fs"`.

Keys (REFERENCE.md: fs takes `root_dir`, `n_read_threads`, `n_write_threads`):
    root_dir (str, required): absolute path of the folder holding one sub-folder per
        namespace; created if absent. A relative path is refused rather than resolved: it
        would name another folder for each working directory, so launches from two folders
        would silently use two caches.
    max_bytes (int > 0): capacity in file bytes (header and padding included); least recently
        used chunks are deleted to stay under it. Default: 90% of the space the filesystem
        has available at start plus what the namespace already holds.
    n_read_threads, n_write_threads (int > 0): threads that load and threads that store
        (default 16 each, as vLLM's fs tier); the store threads also load while no store is
        queued (`jobs.LanePool`), so all 32 read then, as vLLM's do. Each thread keeps one
        request in flight, and the GIL is released for the I/O of a chunk (one call,
        `_chunkio.c`) and its checksum.
    o_direct ("adaptive" | "small" | "small-writes" | "auto" | true | false): which chunk
        files move with O_DIRECT rather than through the page cache (`direct.RULES` is the
        whole rule; README "fs tier I/O mode" has the measurements behind it). "adaptive"
        (default): payloads below `direct.SMALL_CHUNK_BYTES` (1 MiB) both ways and larger
        reads with O_DIRECT; each larger write buffered or with O_DIRECT, whichever the tier
        measured faster for its own recent large writes (`large_io.py`: which wins depends on
        the machine). "small": O_DIRECT for small chunks only. "small-writes": O_DIRECT for
        small writes only, every read buffered. "auto": O_DIRECT for every file (no CPU copy,
        no second copy of a chunk in the page cache, at device speed: the choice where CPU is
        scarce or the disks outrun a memory copy). true: "auto" that refuses to start without
        O_DIRECT. false: never. Any value but true goes buffered where the filesystem lacks
        O_DIRECT, and a chunk whose host bytes are not `ALIGN`-aligned always does.
    refresh_interval_s (number in [0.001, 86400]): how often the index picks up files other
        processes wrote or deleted (default 1.0 s); stretched to 20x the last scan's duration
        when a folder is so big that scanning it takes longer than 1/20 of the interval.
    durability ("process" | "power-loss"): what a finished store survives. "process"
        (default): the file is published by an atomic rename without fsync; it survives any
        process crash, and a power loss or kernel crash may lose recent files or leave them
        torn or zeroed, which the checks on every read and on indexing turn into misses.
        "power-loss": fdatasync the file before the rename and fsync its folder after it, so
        a finished store survives power loss (each store takes several times as long: README
        "fs tier durability").
    recycle_files (bool, default true): a store that must evict to make room overwrites an
        evicted chunk file of its own size in place (renamed to the store's temp name)
        instead of deleting it and creating a new one: the filesystem allocates and frees no
        inode and no blocks (and issues no discard) for a full tier's stores. Readers of the
        evicted chunk get a miss either way. false deletes and creates, as does durability
        "power-loss".
Errors name the key (`root_dir: ...`); the config loader prefixes the list position.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from kvhal.tier import TierError
from ..config_values import positive_int
from .direct import RULES

DEFAULT_THREADS = 16
#: O_DIRECT for small chunks, the mode measured faster for large writes (`direct.RULES`).
DEFAULT_O_DIRECT = "adaptive"
#: The string values of `o_direct` (the others are the booleans true and false).
O_DIRECT_STRINGS = tuple(value for value in RULES if isinstance(value, str))
DEFAULT_REFRESH_INTERVAL_S = 1.0
#: Bounds of `refresh_interval_s`: below 1 ms the refresh thread would spin on the directory;
#: above a day (or NaN/inf) `threading.Event.wait` overflows or the index never refreshes.
MIN_REFRESH_INTERVAL_S = 0.001
MAX_REFRESH_INTERVAL_S = 86400.0
#: Keys the tier ignores because the config loader or plugin system uses them.
_PASSTHROUGH = frozenset({"type", "module_path"})
_KEYS = frozenset({"root_dir", "max_bytes", "n_read_threads", "n_write_threads", "o_direct",
                   "refresh_interval_s", "durability", "recycle_files"})
DURABILITIES = ("process", "power-loss")
DEFAULT_DURABILITY = "process"


@dataclass(frozen=True, slots=True)
class FsConfig:
    """A validated fs tier config (see module docstring); `max_bytes` None = default."""

    root_dir: str
    max_bytes: int | None
    n_read_threads: int
    n_write_threads: int
    o_direct: str | bool
    refresh_interval_s: float
    durability: str = DEFAULT_DURABILITY
    recycle_files: bool = True


def _quoted(value: str) -> str:
    return f'"{value}"'


def parse_config(config: Mapping[str, Any]) -> FsConfig:
    """Validate an fs tier config.

    Raises:
        TierError: a key is missing, unknown or has a bad value; the message starts with the
            key name and states the accepted values.
    """
    unknown = sorted(set(config) - _KEYS - _PASSTHROUGH)
    if unknown:
        raise TierError(f"{unknown[0]}: unknown key for the fs tier; accepted: "
                        f"{', '.join(sorted(_KEYS))}")
    root_dir = config.get("root_dir")
    if not isinstance(root_dir, str) or not root_dir or "\0" in root_dir:
        raise TierError(f"root_dir: required, a non-empty path string without NUL; "
                        f"got {root_dir!r}")
    if not os.path.isabs(root_dir):
        raise TierError(f"root_dir: must be an absolute path, got {root_dir!r} (a relative one "
                        f"would depend on each process's working directory: two launches "
                        f"from different folders would use two caches)")
    o_direct = config.get("o_direct", DEFAULT_O_DIRECT)
    # by type, not ==: 1.0 or numpy's True equal True but would not count as `true` (the
    # tier refuses to start without O_DIRECT only for `o_direct is True`), and an array's ==
    # raises
    if not (isinstance(o_direct, bool)
            or isinstance(o_direct, str) and o_direct in O_DIRECT_STRINGS):
        raise TierError(f"o_direct: must be {', '.join(map(_quoted, O_DIRECT_STRINGS))}, "
                        f"true or false; got {o_direct!r}")
    interval = config.get("refresh_interval_s", DEFAULT_REFRESH_INTERVAL_S)
    if (not isinstance(interval, (int, float)) or isinstance(interval, bool)
            or not MIN_REFRESH_INTERVAL_S <= interval <= MAX_REFRESH_INTERVAL_S):
        raise TierError(f"refresh_interval_s: must be a number of seconds in "
                        f"[{MIN_REFRESH_INTERVAL_S}, {MAX_REFRESH_INTERVAL_S}], got {interval!r}")
    durability = config.get("durability", DEFAULT_DURABILITY)
    if not isinstance(durability, str) or durability not in DURABILITIES:
        raise TierError(f"durability: must be one of {', '.join(map(repr, DURABILITIES))}; "
                        f"got {durability!r}")
    recycle = config.get("recycle_files", True)
    if not isinstance(recycle, bool):
        raise TierError(f"recycle_files: must be true or false, got {recycle!r}")
    return FsConfig(root_dir, positive_int(config, "max_bytes", None),
                    positive_int(config, "n_read_threads", DEFAULT_THREADS),
                    positive_int(config, "n_write_threads", DEFAULT_THREADS),
                    o_direct, float(interval), durability, recycle)
