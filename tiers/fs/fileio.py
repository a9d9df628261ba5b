"""Writing and reading one chunk file: the fs tier's hot path (format in `format.py`).

Every function takes the `os` module to use as `osm` (the real `os` in production; tests pass a
`Faulty...` wrapper to inject errno values a real disk cannot produce on demand). Payloads are
memoryviews into the host region: with O_DIRECT the aligned bulk of the payload moves straight
between the host slot and the disk, and only the header block and the last partial block pass
through a small per-thread aligned scratch buffer.

With the real `os` module, the system calls of one chunk (open, pwritev/preadv, fstat, close,
rename) run in one GIL-free call of the C helper `_chunkio` when it was built: the same calls,
flags and order as the Python path below, without a GIL handoff per call (with 16+16 tier
threads the handoffs, not the disk, bound throughput). `FAST_IO` says which path runs; checks
and header fields stay here, in Python, for both. The payload checksum (and, for a write, the
header digest over it) is computed in that same call when python-xxhash's C functions could be
bound (`HASH_IN_C`) and the payload is whole blocks: one GIL handoff per chunk instead of two.
`write_chunks` and `read_chunks` move a batch of such chunks in one call, one GIL handoff per
batch (README "fs tier I/O mode" has what that saves).
"""
from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
import time

from kvhal.keys import ChunkKey

from ..chunk_format import (ALIGN, CHECKSUM_OFFSET, HEADER_BYTES, CorruptChunk, FormatError,
                            Header, SizeMismatch, check_record_size, checked_header,
                            decode_header, encode_header, encode_header_fields,
                            payload_checksum, record_nbytes, verify_payload)
from .format import QUARANTINE_DIR, TEMP_SUFFIX, chunk_paths

try:  # the C helper (`_chunkio.c`, built by setup.py where a C compiler is found)
    from . import _chunkio
except ImportError:  # no compiler at install time: the same calls, made from Python
    _chunkio = None


def _bind_hasher() -> bool:
    """Give `_chunkio` python-xxhash's own `XXH3_128bits` and `XXH3_64bits` (its extension
    exports the xxHash C API), so a read is verified, and a write's header sealed, in the same
    GIL-free call that moves the file; True if bound. Both are checked against
    `xxhash.xxh3_128_digest` and `xxh3_64_intdigest` on a sample first; on any doubt the
    checksums stay Python calls."""
    if _chunkio is None:
        return False
    try:
        import ctypes

        import xxhash
        import xxhash._xxhash as native

        lib = ctypes.CDLL(native.__file__)
        addresses = [ctypes.cast(fn, ctypes.c_void_p).value or 0
                     for fn in (lib.XXH3_128bits, lib.XXH3_64bits)]
        _chunkio.set_hasher(*addresses)
        sample = bytes(range(256)) * 67 + b"kvhal"
        if (all(addresses) and _chunkio.xxh3_128(sample) == xxhash.xxh3_128_digest(sample)
                and _chunkio.xxh3_64(sample) == xxhash.xxh3_64_intdigest(sample)):
            return True
    except (ImportError, OSError, AttributeError, TypeError):
        pass
    _chunkio.set_hasher(0, 0)
    return False

O_DIRECT = getattr(os, "O_DIRECT", 0)
#: True if chunk files are moved by the C helper (one GIL release per chunk) with the real `os`.
FAST_IO = _chunkio is not None
#: True if the C helper also computes the payload checksum in that call: a read's, to verify
#: it, and a write's with its header digest, to seal the header (`_bind_hasher`).
HASH_IN_C = _bind_hasher()
#: Opening a chunk file never blocks: O_NONBLOCK makes a FIFO (or device) planted under a
#: chunk name open at once, and `_regular_file_size` then refuses it.
_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK


class Scratch:
    """`ALIGN`-aligned blocks (from an anonymous mmap): `headers` (`batch` of them, one per chunk
    of a `write_chunks` / `read_chunks` batch), `header` (the first) and `tail`. One per thread.
    """

    def __init__(self, batch: int = 1) -> None:
        self._mm = mmap.mmap(-1, (batch + 1) * ALIGN)
        view = memoryview(self._mm)
        self.headers = [view[i * ALIGN:(i + 1) * ALIGN] for i in range(batch)]
        self.header = self.headers[0]
        self.tail = view[batch * ALIGN:]


def probe_o_direct(folder: str) -> bool:
    """True if files in `folder` can be written and read back with O_DIRECT and `ALIGN`-sized,
    `ALIGN`-aligned buffers (Linux ext4/xfs: yes; tmpfs before Linux 6.6: no). Never raises."""
    if not O_DIRECT:
        return False
    path = os.path.join(folder, f".o_direct_probe.{os.getpid()}.{os.urandom(4).hex()}")
    scratch = Scratch()
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | O_DIRECT, 0o600)
        try:
            scratch.header[:] = b"\xa5" * ALIGN
            if os.pwritev(fd, [scratch.header], 0) != ALIGN:
                return False
            return os.preadv(fd, [scratch.tail], 0) == ALIGN and scratch.tail == scratch.header
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


def fsync_dir(osm, folder: str) -> None:
    """fsync a directory so that a rename or unlink inside it is durable."""
    fd = osm.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        osm.fsync(fd)
    finally:
        os.close(fd)


def _regular_file_size(st: os.stat_result) -> int:
    """Size in bytes of the file whose (f)stat is `st`.

    Raises:
        CorruptChunk: not a regular file (a FIFO, device, socket or folder).
    """
    if not stat.S_ISREG(st.st_mode):
        raise CorruptChunk(f"not a regular file (mode {stat.filemode(st.st_mode)})")
    return st.st_size


def _split(payload: memoryview) -> tuple[memoryview, int]:
    bulk = len(payload) - len(payload) % ALIGN
    return payload[:bulk], len(payload) - bulk


def _write_all(osm, fd: int, bufs: list[memoryview]) -> int:
    """Write `bufs` in order from offset 0 (short writes continued); returns the bytes written."""
    offset = 0
    bufs = [b for b in bufs if len(b)]
    while bufs:
        n = osm.pwritev(fd, bufs, offset)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += n
        while bufs and n >= len(bufs[0]):
            n -= len(bufs[0])
            bufs.pop(0)
        if n:
            bufs[0] = bufs[0][n:]
    return offset


def _single_regular_file(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1


def _open_temp(osm, tmp: str, flags: int, reuse: str | None) -> tuple[int, bool]:
    """Open `tmp` for writing: the file at `reuse` renamed to `tmp` if given and possible
    (recycled: no O_CREAT), else a new file. Returns (fd, recycled). Raises OSError from the
    create. The steps and checks of `_chunkio.write_file`'s recycling: only a regular file
    with one link (never a symlink's target or a hard link's other name), its mtime made
    fresh before the rename (no scan takes it for a dead writer's temp file), opened
    O_NOFOLLOW|O_NONBLOCK (a FIFO put in its place never blocks) and checked again; a
    `reuse` that fails any of it is unlinked (best effort), as an eviction would."""
    if reuse is not None:
        try:
            if not _single_regular_file(os.lstat(reuse)):
                raise OSError(errno.EINVAL, "not a regular file with one link", reuse)
            os.utime(reuse, follow_symlinks=False)
            osm.rename(reuse, tmp)
        except OSError:
            unlink_file(reuse)
        else:
            try:
                fd = osm.open(tmp, flags | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                unlink_file(tmp)
            else:
                try:
                    if not _single_regular_file(os.fstat(fd)):
                        raise OSError(errno.EINVAL, "replaced while recycled", tmp)
                    fcntl.fcntl(fd, fcntl.F_SETFL, flags & O_DIRECT)
                except OSError:
                    os.close(fd)
                    unlink_file(tmp)
                else:
                    return fd, True
    return osm.open(tmp, flags | os.O_CREAT | os.O_EXCL, 0o644), False


def unlink_file(path: str) -> bool:
    """Unlink `path`; True if this call removed it, False if it failed (gone already:
    another process removed it first; or any other OSError)."""
    try:
        os.unlink(path)
    except OSError:
        return False
    return True


def file_size(path: str) -> int:
    """Bytes of the file `path` names (not following a symlink); 0 if there is none."""
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0


def claim_file(path: str, claimed: str) -> str | None:
    """Rename the chunk file at `path` (evicted, or a copy of the chunk a store writes) to the
    temp name `claimed` (`format.chunk_paths` of the storing key) so that only this process
    can recycle it (`write_chunk`'s `reuse`, which makes its mtime fresh: a scan
    that meanwhile takes the old file for a dead writer's temp file and removes it costs the
    store its recycling, nothing else). Returns `claimed`, or None if `path` is no lone
    regular file (`_open_temp` tells why) or the rename failed (ENOENT: another process
    removed it first)."""
    try:
        if not _single_regular_file(os.lstat(path)):
            return None
        os.rename(path, claimed)
    except OSError:
        return None
    return claimed


def write_chunk(osm, ns_dir: str, key: ChunkKey, payload: memoryview, direct: bool,
                scratch: Scratch, sync: bool, reuse: str | None = None) -> bool:
    """Publish `payload` as the chunk file of `key` inside `ns_dir`.

    Writes header + payload + zero padding to a unique temp file (O_DIRECT if `direct`, which
    needs `payload` to start at an `ALIGN`-aligned address) and renames it over the chunk path
    (atomic: readers see the old file, no file, or the complete new file). With `sync` the
    temp file is fdatasynced before the rename and the chunk folder fsynced after it, so the
    file survives power loss; without, it survives a crash of any process (the kernel holds
    it), and a power loss may leave it missing, short, zeroed or torn, which `read_chunk` and
    the directory scan detect. On any error the temp file is removed.

    `reuse` (the path of an evicted chunk file, or None): that file is renamed to the temp
    name and overwritten in place instead of a new one being created, so the filesystem
    allocates no inode and no blocks for the store and frees none for the eviction (on ext4,
    creating a file after many deletes can cost more than writing it). A reader that opened
    the evicted file before reads a mix of two chunks, which its key and checksum checks turn
    into a miss (`read_chunk`); readers that open it later find no file. If `reuse` cannot
    be renamed it is unlinked and a new file created. A `reuse` that is a temp name in the folder
    of `key`'s chunk file already (`claim_file` put it there) is overwritten where it lies
    (renamed onto itself: one rename saved).

    Returns:
        True if `reuse` was recycled, False if a new file was created.

    Raises:
        OSError: from any step (ENOSPC, EIO, EACCES, ...); nothing is left behind (`reuse`,
            once renamed, goes with the temp file).
    """
    bulk, rem = _split(payload)
    fast = osm is os and _chunkio is not None
    # sealed in C: the payload lies whole in `bulk` (no tail block) and can be handed on
    seal = fast and HASH_IN_C and not rem and len(bulk) and not payload.readonly
    if seal:
        digest_at = encode_header_fields(scratch.header, key, len(payload))
    else:
        encode_header(scratch.header, key, len(payload), payload_checksum(payload))
    bufs = [scratch.header, bulk]
    if rem:
        scratch.tail[:rem] = payload[len(bulk):]
        scratch.tail[rem:] = bytes(ALIGN - rem)
        bufs.append(scratch.tail)
    folder, final, tmp = chunk_paths(ns_dir, key)
    if reuse is not None and reuse.endswith(TEMP_SUFFIX) and os.path.dirname(reuse) == folder:
        tmp = reuse
    if fast:
        return _chunkio.write_file(tmp, final, bufs, direct, sync, folder,
                                   *((CHECKSUM_OFFSET, digest_at) if seal else (-1, -1)), reuse)
    flags = os.O_WRONLY | os.O_CLOEXEC | (O_DIRECT if direct else 0)
    fd, recycled = _open_temp(osm, tmp, flags, reuse)
    try:
        try:
            written = _write_all(osm, fd, bufs)
            if recycled:
                osm.ftruncate(fd, written)
            if sync:
                osm.fdatasync(fd)
        finally:
            os.close(fd)
        osm.rename(tmp, final)
    except BaseException:
        unlink_file(tmp)
        raise
    if sync:
        fsync_dir(osm, folder)
    return recycled


def batchable(payload: memoryview) -> bool:
    """True if `write_chunks` and `read_chunks` take `payload` (with the real `os` module): the
    C helper is built with its hashers bound, and the payload is whole `ALIGN` blocks of a
    writable buffer (no tail block passes through the scratch buffer)."""
    return (_chunkio is not None and HASH_IN_C and len(payload) > 0 and len(payload) % ALIGN == 0
            and not payload.readonly)


def write_chunks(ns_dir: str, jobs: list[tuple[ChunkKey, memoryview, bool]],
                 sync: bool, scratch: Scratch) -> list[OSError | None]:
    """`write_chunk` (with the real `os` module, recycling no file) for each (key, payload,
    direct) of `jobs`, in order, in one GIL-free call of the C helper: one outcome per job,
    None (written) or the OSError `write_chunk` would raise. Every payload must be
    `batchable`; `jobs` holds at most `len(scratch.headers)` jobs.

    Raises:
        ValueError: more jobs than header blocks (nothing is written).
    """
    if len(jobs) > len(scratch.headers):
        raise ValueError(f"{len(jobs)} jobs for {len(scratch.headers)} header blocks")
    args = []
    for (key, payload, direct), header in zip(jobs, scratch.headers):
        digest_at = encode_header_fields(header, key, len(payload))
        folder, final, tmp = chunk_paths(ns_dir, key)
        args.append((tmp, final, [header, payload], direct, sync, folder, CHECKSUM_OFFSET,
                     digest_at, None))
    # the C helper gives False (a new file) or the OSError per job
    return [outcome if isinstance(outcome, OSError) else None
            for outcome in _chunkio.write_files(args)]


def read_chunks(jobs: list[tuple[str, ChunkKey, memoryview, bool]], namespace: bytes,
                scratch: Scratch) -> list[bool]:
    """Read the chunk file at path into dest for each (path, key, dest, direct) of `jobs`, in
    order, in one GIL-free call of the C helper, and verify each as `read_chunk` does. Returns
    per job True (complete and verified) or False (any failure: the caller then learns what
    failed from `read_chunk`, which reads the file again). A False job's dest is garbage. Every
    dest must be `batchable`; `jobs` holds at most `len(scratch.headers)` jobs.

    Raises:
        ValueError: more jobs than header blocks (nothing is read).
    """
    if len(jobs) > len(scratch.headers):
        raise ValueError(f"{len(jobs)} jobs for {len(scratch.headers)} header blocks")
    outcomes = _chunkio.read_files([(path, [header, dest], direct, record_nbytes(len(dest)), 1)
                                    for (path, _, dest, direct), header
                                    in zip(jobs, scratch.headers)])
    return [_verified(outcome, header, key, len(dest), namespace)
            for (_, key, dest, _), header, outcome in zip(jobs, scratch.headers, outcomes)]


def _verified(outcome: tuple | OSError, header_block: memoryview, key: ChunkKey,
              payload_nbytes: int, namespace: bytes) -> bool:
    if isinstance(outcome, OSError):
        return False
    status, n, digest, _ = outcome
    if status or digest is None:
        return False
    try:
        header = _checked_record(n, header_block, key, namespace, payload_nbytes)
    except (CorruptChunk, SizeMismatch):
        return False
    return digest == header.checksum


def _checked_record(n: int, header_block: memoryview, key: ChunkKey, namespace: bytes,
                    payload_nbytes: int) -> Header:
    """The header of a chunk file read whole (`n` bytes) for a payload of `payload_nbytes`,
    checked against `key` and `namespace`; the caller compares the payload's checksum.

    Raises:
        CorruptChunk: a short read, or a bad header (`checked_header`).
        SizeMismatch: a valid header for a payload of another size.
    """
    expected = record_nbytes(payload_nbytes)
    if n != expected:
        raise CorruptChunk(f"short read: {n} of {expected} bytes")
    header = checked_header(header_block, key, namespace)
    if header.payload_nbytes != payload_nbytes:
        raise SizeMismatch(f"payload {header.payload_nbytes} bytes != requested "
                           f"{payload_nbytes}")
    return header


def read_chunk(osm, path: str, key: ChunkKey, dest: memoryview, namespace: bytes, direct: bool,
               scratch: Scratch) -> None:
    """Read the chunk file at `path` into `dest` and verify it completely.

    `dest` receives the payload even when a check fails afterwards; the caller must then treat
    `dest` as garbage. With `direct`, `dest` must start at an `ALIGN`-aligned address.

    Raises:
        OSError: the file cannot be opened or read (ENOENT, EACCES, EIO, ...).
        CorruptChunk: not a regular file, short file, bad header, other key or namespace,
            checksum mismatch; its `file_id` names the file read (`same_file`).
        SizeMismatch: a valid file whose payload size is not `len(dest)`.
    """
    expected = record_nbytes(len(dest))
    bulk, rem = _split(dest)
    bufs = [b for b in [scratch.header, bulk] + ([scratch.tail] if rem else []) if len(b)]
    digest = file_id = None
    try:
        if osm is os and _chunkio is not None:
            # the payload is verified in C when it lies whole in `bulk` (bufs[1]): no tail block
            verify = 1 if HASH_IN_C and not rem and len(bulk) else -1
            status, n, digest, file_id = _chunkio.read_file(path, bufs, direct, expected,
                                                            verify)
            if status == _NOT_REGULAR:
                raise CorruptChunk(f"not a regular file (mode {stat.filemode(n)})")
            if status == _OTHER_SIZE:
                fd = os.open(path, _READ_FLAGS)
                try:
                    _raise_size_problem(os, fd, n, expected, scratch)
                finally:
                    os.close(fd)
        else:
            try:
                fd = osm.open(path, _READ_FLAGS | (O_DIRECT if direct else 0))
            except OSError as exc:   # O_DIRECT refuses a FIFO or a directory: fstat says
                if not direct or exc.errno != errno.EINVAL:
                    raise
                fd = osm.open(path, _READ_FLAGS)
            try:
                st = os.fstat(fd)
                file_id = _file_id(st)
                size = _regular_file_size(st)
                if size != expected:
                    _raise_size_problem(osm, fd, size, expected, scratch)
                n = osm.preadv(fd, bufs, 0)
            finally:
                os.close(fd)
        header = _checked_record(n, scratch.header, key, namespace, len(dest))
        if rem:
            dest[len(bulk):] = scratch.tail[:rem]
        if (digest if digest is not None else payload_checksum(dest)) != header.checksum:
            raise CorruptChunk("checksum mismatch")
    except CorruptChunk as exc:
        exc.file_id = file_id
        raise


def _file_id(st: os.stat_result) -> tuple[int, int, int]:
    """(st_dev, st_ino, st_ctime_ns): a file, and whether it changed since."""
    return st.st_dev, st.st_ino, st.st_ctime_ns


def same_file(path: str, file_id: tuple[int, int, int]) -> bool:
    """True if `path` still names the file `file_id` (`CorruptChunk.file_id`) unchanged: not
    replaced, renamed away, rewritten or gone since it was read."""
    try:
        return _file_id(os.stat(path)) == file_id
    except OSError:
        return False


#: `_chunkio.read_file` statuses (besides 0, read): not a regular file, a file of another size.
_NOT_REGULAR, _OTHER_SIZE = 1, 2


def _raise_size_problem(osm, fd: int, size: int, expected: int, scratch: Scratch):
    if size >= HEADER_BYTES and osm.preadv(fd, [scratch.header], 0) == HEADER_BYTES:
        try:
            header = decode_header(scratch.header)
        except FormatError:
            header = None
        if header is not None and record_nbytes(header.payload_nbytes) == size:
            raise SizeMismatch(f"payload {header.payload_nbytes} bytes != requested "
                               f"{expected - HEADER_BYTES} (padded)")
    raise CorruptChunk(f"file size {size} != expected {expected}")


def read_header(path: str, namespace: bytes) -> tuple[Header, int]:
    """Read and check only the header of the chunk file at `path`; returns it and the file
    size. Used when indexing a directory (no payload is read).

    Raises:
        OSError: the file cannot be opened or read.
        CorruptChunk: not a regular file, bad header, other namespace, or a size that does
            not match the header.
    """
    fd = os.open(path, _READ_FLAGS)
    try:
        size = _regular_file_size(os.fstat(fd))
        block = os.pread(fd, HEADER_BYTES, 0)
    finally:
        os.close(fd)
    header = checked_header(block, None, namespace)
    check_record_size(header, size, None)
    return header, size


def verify_file(path: str, namespace: bytes, key: ChunkKey | None) -> Header:
    """Fully verify the chunk file at `path` (buffered read): header, key, size, checksum. Reads
    the payload only after the header and the file size agree (a huge file with a chunk name
    costs one header read, never its size in memory).

    Raises:
        OSError: the file cannot be opened or read.
        CorruptChunk: any check fails.
    """
    with open(os.open(path, _READ_FLAGS), "rb", buffering=0) as f:
        size = _regular_file_size(os.fstat(f.fileno()))
        header = checked_header(f.read(HEADER_BYTES), key, namespace)
        check_record_size(header, size, None)  # before reading the payload
        payload = f.read(header.payload_nbytes)
    verify_payload(header, payload)
    return header


def quarantine_file(ns_dir: str, path: str) -> bool:
    """Move the chunk file at `path` into `ns_dir/quarantine/` under a unique name (kept for
    inspection, never read again). Returns False if it could not be moved (e.g. already gone)."""
    dest = os.path.join(ns_dir, QUARANTINE_DIR,
                        f"{os.path.basename(path)}.{time.time_ns()}.{os.urandom(4).hex()}")
    try:
        os.rename(path, dest)
    except OSError:
        return False
    return True
