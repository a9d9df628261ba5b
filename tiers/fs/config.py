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
    o_direct ("adaptive" | "small" | "small-writes" | "auto" | true | false): "small" writes
        and reads chunk files whose payload is less than `SMALL_CHUNK_BYTES` (1 MiB) with
        O_DIRECT where the filesystem supports it and its host bytes are `ALIGN`-aligned, and
        moves every larger one through the page cache; "adaptive" (default) does the same for
        small chunks, reads every larger one with O_DIRECT, and writes each larger one
        buffered or with O_DIRECT, whichever the tier measured faster for its own recent
        large writes (`large_io.py`: buffered writes won on three machines and lost 0.42x
        against 0.97x on a fourth; measured choices of read mode lost 8-17% against O_DIRECT
        reads on two VMs); "small-writes" uses O_DIRECT for
        small writes only (every read buffered); "auto" uses O_DIRECT for every write and read
        where supported; true refuses to start without it; false never uses it.
        Measured with `kvhal bench tier` (issue 13), kvhal against vLLM's fs tier (which uses
        O_DIRECT):
        - Buffered is faster for 2 MiB chunks on both machines measured (writes 1.5-4.9x
          vLLM, reads 1.3-1.7x): the page cache takes a burst of stores at memory speed and
          writes it back behind them (a sustained stream is throttled to device speed by the
          kernel), and read-ahead keeps the disk busier. With O_DIRECT: writes 0.87x.
        - For 256 KiB chunks, on a VM where touching fresh memory costs ~0.7 GB/s (page
          faults), buffered writes measured 0.54-0.71x vLLM; O_DIRECT writes 1.39-1.40x in
          two runs of "auto" and 0.83-1.03x in three runs of "small-writes": a small write
          then takes the kernel path vLLM's takes, where kvhal's one-call write is at least at
          par.
        - Reads of 256 KiB chunks, "small-writes" (buffered) against "small" (O_DIRECT) in one
          run of 7 alternating passes on the project's VM (session 7): median 1.15 against
          1.37 GB/s (vLLM 1.44), at 225 against 153 us of CPU per chunk: the copy out of the
          page cache and its bookkeeping were a third of the read threads' CPU time (`perf`).
          A small chunk is written with O_DIRECT, so the page cache never holds it for a read
          to hit (a session-5 machine had measured buffered reads 1.15-1.23x vLLM, in runs
          other than its O_DIRECT reads' 0.91-0.97x).
        O_DIRECT costs no CPU copy and keeps chunk files out of the page cache (no second
        copy of chunks the host tier may still hold), at device speed: prefer "auto" when
        CPU is scarce (on a 2-core machine at load 20-35 buffered I/O measured 0.26 GB/s
        against 0.48-1.68 with O_DIRECT) or the disks are faster than the memory copy.
    refresh_interval_s (number in [0.001, 86400]): how often the index picks up files other
        processes wrote or deleted (default 1.0 s); stretched to 20x the last scan's duration
        when a folder is so big that scanning it takes longer than 1/20 of the interval.
    durability ("process" | "power-loss"): what a finished store survives. "process"
        (default): the file is published by an atomic rename without fsync; it survives any
        process crash, and a power loss or kernel crash may lose recent files or leave them
        torn or zeroed, which the checks on every read and on indexing turn into misses.
        "power-loss": fdatasync the file before the rename and fsync its folder after it, so
        a finished store survives power loss (about 2-3x the write time per chunk here).
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

DEFAULT_THREADS = 16
#: O_DIRECT for small chunks, the faster measured mode otherwise (see the module docstring's
#: measurements).
DEFAULT_O_DIRECT = "adaptive"
#: Chunk payloads below this many bytes are written (and under "small" read) with O_DIRECT
#: under "small" and "small-writes" (between the 256 KiB chunks where O_DIRECT won and the
#: 2 MiB where buffered did).
SMALL_CHUNK_BYTES = 1 << 20
#: The string values of `o_direct` (the others are the booleans true and false).
O_DIRECT_STRINGS = ("adaptive", "small", "small-writes", "auto")
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
        raise TierError(f"o_direct: must be \"adaptive\", \"small\", \"small-writes\", "
                        f"\"auto\", true or false; got {o_direct!r}")
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
