"""The descriptions an fs tier keeps of its chunks (`TierJob.description`: token ids, parent hash,
LoRA, for routers), in append-only logs beside the chunk folders.

    <namespace hex>/descriptions/<pid>.<random hex>.log     one per writing process

A log starts with `MAGIC` (its format version) and holds records `<u32 length><u32 crc32>
<payload>`, payload = `<u16 group><u8 hash bytes><block hash><description>`; a later record of a
key replaces an earlier one. A writer appends one record with one `write` after the chunk's
file is renamed into place, so a record never names a chunk that was not whole; a record cut by
a crash fails its length or checksum and ends the reading of that log (the rest of it cannot be
trusted to be framed), and its chunk is announced without a description. Logs of another
version are skipped, so chunk folders written by older kvhal versions (no logs) load as they
are. Chunk files are untouched: their format and write rules (`fileio.py`) stay as they are.

At start the tier folds every log into one of its own (written under a temp name and renamed,
like chunk files), keeping only keys whose chunk files exist, and deletes the logs whose writer
is gone; a running tier appends to its own and rewrites it once it holds more records of chunks
gone than of chunks held (`prune`, on the listing thread). Only the location of each record is
kept in memory (descriptions are read when a found chunk is announced, on the thread that lists
the folder).
"""
from __future__ import annotations

import contextlib
import os
import struct
import threading
import zlib
from collections.abc import Container, Iterable

from kvhal.keys import ChunkKey
from kvhal.tier import MAX_DESCRIPTION_BYTES

from .scan import pid_alive

DESCRIPTIONS_DIR = "descriptions"
LOG_SUFFIX = ".log"
#: Dead records of a process's own log (`prune`) below which it is never rewritten.
FOLD_MIN = 4096
#: First bytes of every log: format version 1.
MAGIC = b"KVHALD1\n"
_FRAME = struct.Struct("<II")
_KEY = struct.Struct("<HB")
#: Largest record payload: key, 255-byte block hash, description.
_MAX_PAYLOAD = _KEY.size + 255 + MAX_DESCRIPTION_BYTES
#: Bytes of a log read at a time.
READ_BYTES = 4 << 20


def encode_record(key: ChunkKey, description: bytes) -> bytes:
    """One framed log record of `key`'s `description`."""
    payload = _KEY.pack(key.group, len(key.block_hash)) + key.block_hash + description
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def read_records(path: str, start: int = 0) -> tuple[list[tuple[int, int, bytes, int]], int]:
    """Records of the log at `path` from byte `start` (0: check `MAGIC` first):
    [(group, payload offset, block hash, description length)], and the offset after the last
    whole, checked record. A torn or corrupt record ends the list. A log of another version,
    or one that cannot be read, gives none. Reads `READ_BYTES` at a time (a log can be
    hundreds of MB).
    """
    out: list[tuple[int, int, bytes, int]] = []
    buf, base, i = b"", start, 0        # base: the file offset of buf[0]; i: parsed up to
    try:
        with open(path, "rb") as f:
            if start == 0:
                if f.read(len(MAGIC)) != MAGIC:
                    return [], 0
                base = len(MAGIC)
            f.seek(base)
            while True:
                if len(buf) - i >= _FRAME.size:
                    length, crc = _FRAME.unpack_from(buf, i)
                    if not _KEY.size <= length <= _MAX_PAYLOAD:
                        break
                    body = i + _FRAME.size
                    if len(buf) - body >= length:
                        payload = buf[body:body + length]
                        if zlib.crc32(payload) != crc:
                            break
                        group, hash_len = _KEY.unpack_from(payload)
                        desc_at = _KEY.size + hash_len
                        if desc_at > length:
                            break
                        out.append((group, base + body + desc_at,
                                    payload[_KEY.size:desc_at], length - desc_at))
                        i = body + length
                        continue
                more = f.read(READ_BYTES)
                if not more:
                    break
                buf, base, i = buf[i:] + more, base + i, 0
    except OSError:
        return [], start
    return out, base + i


class DescriptionLogs:
    """The description logs of one namespace folder (module docstring). Thread-safe.

    Args:
        ns_dir: The namespace folder.
        namespace: Its 16-byte namespace.
    """

    def __init__(self, ns_dir: str, namespace: bytes):
        self.folder = os.path.join(ns_dir, DESCRIPTIONS_DIR)
        self.namespace = namespace
        self._lock = threading.Lock()
        #: key → (log path, offset of the description, length)
        self._where: dict[ChunkKey, tuple[str, int, int]] = {}
        self._read_to: dict[str, int] = {}      # log path → offset read up to
        self._own: str | None = None
        self._fd: int | None = None
        self._open = False
        self._dead = 0          # records of this process's log for chunks no longer held

    def open(self, held: Iterable[ChunkKey]) -> None:
        """Fold every log into a new one of this process's, keeping the records of `held`
        (the chunks the folder holds), delete the logs of writers that are gone, and append
        to the new log from now on (made at the first record if no record was kept). When
        the fold cannot be written (a full disk), every log is left as it is and read from
        where it is. Never raises for I/O errors."""
        self._read_new()
        held = set(held)
        token = f"{os.getpid()}.{os.urandom(8).hex()}"
        own = os.path.join(self.folder, f"{token}{LOG_SUFFIX}")
        with self._lock:
            chunks, where, pos = [MAGIC], {}, len(MAGIC)
            for key, (path, offset, length) in self._where.items():
                description = _read_at(path, offset, length) if key in held else None
                if description is None:
                    continue
                record = encode_record(key, description)
                chunks.append(record)
                where[key] = (own, pos + len(record) - length, length)
                pos += len(record)
            _OWN.add(own)
            folded = True
            if where:
                temp = os.path.join(self.folder, f"{token}.tmp")
                try:
                    with open(temp, "wb") as f:
                        f.write(b"".join(chunks))
                    os.rename(temp, own)
                except OSError:     # a full disk: the records stay in the logs they are in
                    folded = False
                    with contextlib.suppress(OSError):
                        os.unlink(temp)
            if folded:
                for path in list(self._read_to) + _temp_files(self.folder):
                    if _writer_gone(path):
                        try:
                            os.unlink(path)
                        except OSError:
                            pass
                        self._read_to.pop(path, None)
                self._where = where
            else:
                self._where = {k: w for k, w in self._where.items() if k in held}
            self._own, self._fd = own, None
            self._open = True

    def append(self, key: ChunkKey, description: bytes) -> None:
        """Record `description` of `key` (whose chunk file is in place) unless a record of the
        same length is there already. Never raises for I/O errors (the chunk is then
        announced without a description after a restart)."""
        if len(description) > MAX_DESCRIPTION_BYTES:
            return
        with self._lock:
            if not self._open:
                return
            known = self._where.get(key)
            if known is not None and known[2] == len(description):
                return
            record = encode_record(key, description)
            try:
                if self._fd is None:
                    os.makedirs(self.folder, exist_ok=True)
                    self._fd = os.open(self._own, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                pos = os.lseek(self._fd, 0, os.SEEK_END)
                data = (MAGIC if pos == 0 else b"") + record
                if os.write(self._fd, data) != len(data):     # cut short: the disk is full
                    os.ftruncate(self._fd, pos)     # a torn record would end every reading
                    return
            except OSError:
                return
            pos = max(pos, len(MAGIC))
            self._where[key] = (self._own, pos + len(record) - len(description),
                                len(description))

    def refresh(self) -> None:
        """Read what other processes appended to their logs since the last call."""
        self._read_new()

    def prune(self, held: Container[ChunkKey]) -> None:
        """Forget the records of chunks no longer `held` (evicted, deleted); once the records
        this process's log holds for such chunks outnumber the live ones (and `FOLD_MIN`),
        rewrite that log with the live ones only (temp name, then rename), so a long run's log
        stays within about twice its live records. Never raises for I/O errors (the log is
        then left as it was)."""
        with self._lock:
            for key in [k for k in self._where if k not in held]:
                if self._where.pop(key)[0] == self._own:
                    self._dead += 1
            live = {k: w for k, w in self._where.items() if w[0] == self._own}
            if self._fd is None or self._dead < max(FOLD_MIN, len(live)):
                return
            temp = f"{self._own}.{os.urandom(4).hex()}.tmp"
            chunks, where, pos = [MAGIC], {}, len(MAGIC)
            for key, (path, offset, length) in live.items():
                description = _read_at(path, offset, length)
                if description is None:
                    continue
                record = encode_record(key, description)
                chunks.append(record)
                where[key] = (self._own, pos + len(record) - length, length)
                pos += len(record)
            try:
                with open(temp, "wb") as f:
                    f.write(b"".join(chunks))
                os.rename(temp, self._own)
                fd = os.open(self._own, os.O_WRONLY | os.O_APPEND)
            except OSError:
                return
            os.close(self._fd)
            self._fd, self._dead = fd, 0
            self._where.update(where)

    def get(self, key: ChunkKey) -> bytes | None:
        """The last description recorded of `key`, or None (reads it from its log)."""
        with self._lock:
            where = self._where.get(key)
        return None if where is None else _read_at(*where)

    def close(self) -> None:
        """Stop appending. Idempotent."""
        with self._lock:
            fd, self._fd, self._open = self._fd, None, False
            _OWN.discard(self._own)        # a later tier of this process folds it
        if fd is not None:
            os.close(fd)

    def _read_new(self) -> None:
        try:
            names = [n for n in os.listdir(self.folder) if n.endswith(LOG_SUFFIX)]
        except OSError:
            return
        for name in names:
            path = os.path.join(self.folder, name)
            if path == self._own:
                continue
            records, end = read_records(path, self._read_to.get(path, 0))
            with self._lock:
                self._read_to[path] = end
                for group, offset, block_hash, length in records:
                    self._where[ChunkKey(self.namespace, group, block_hash)] = (path, offset,
                                                                                length)


def _read_at(path: str, offset: int, length: int) -> bytes | None:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(length)
    except OSError:
        return None
    return data if len(data) == length else None


#: Logs this process writes now (a log of this pid not among them is a closed tier's, or a
#: former process's of the same pid).
_OWN: set[str] = set()


def _temp_files(folder: str) -> list[str]:
    try:
        return [os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".tmp")]
    except OSError:
        return []


def _writer_gone(path: str) -> bool:
    """Whether the process that wrote the log (or temp file) at `path` (pid in its name) is
    gone: not running, or this pid's former process (a container's pid is often reused)."""
    try:
        pid = int(os.path.basename(path).split(".", 1)[0])
    except ValueError:
        return True
    if pid == os.getpid():
        return path not in _OWN
    return not pid_alive(pid)
