"""The "disk" row of `kvhal bench tier --tier fs`: what the disk itself does for this I/O.

Every other fs contender creates one file per chunk, so its writes pay the filesystem's
per-file work (an inode and blocks allocated, a directory entry added and renamed) besides the
transfer. This loop moves the same chunks, on as many threads as the kvhal tier moves them
with, at offsets `i * chunk_bytes` of one file that was written in full before the first pass:
every timed write overwrites blocks already allocated, and no file is created. It is the ceiling a
file-per-chunk tier can reach on this disk at this chunk size and queue depth, with O_DIRECT
where the filesystem takes it (otherwise through the page cache, emptied before every read
like the other contenders' files). No checksum, no fsync.

The gap to the file-per-chunk rows is the filesystem's per-file cost; on ext4 without a
journal it is mostly the inode allocator, which skips every inode freed in the last 60-360 s
(`recently_deleted`) after a large delete (figures: README, `kvhal bench tier`).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def _takes_o_direct(path: str) -> bool:
    """True if `path` (an existing file) opens with O_DIRECT (tmpfs and some FUSE mounts
    refuse it with EINVAL)."""
    if not _O_DIRECT:
        return False
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_CLOEXEC | _O_DIRECT))
    except OSError:
        return False
    return True


class DiskLoop:
    """Chunk-sized pwritev/preadv into one preallocated file under `root` (module docstring).

    Args:
        root: folder for the file `disk.img` (chunk_bytes * count bytes, written once here).
        host: the host region the chunks move from and to (chunk i at i * chunk_bytes).
        chunk: chunk size in bytes; O_DIRECT only if a multiple of 4096 and the file takes it.
        count: chunks per pass.
        threads: (read threads, write threads), those the kvhal tier moves chunks with
            (`FsTier.io_threads`).

    Raises:
        OSError: the file cannot be created or written in `root`.
    """

    name = "disk (no files)"
    durability = "none (no files, no fsync)"

    def __init__(self, root: str, host: memoryview, chunk: int, count: int,
                 threads: tuple[int, int]) -> None:
        self.host, self.chunk, self.count, self.threads = host, chunk, count, threads
        self.path = os.path.join(root, "disk.img")
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            done, total = 0, chunk * count
            while done < total:
                done += os.pwritev(fd, [host[done:total]], done)
            os.fsync(fd)
        finally:
            os.close(fd)
        self.o_direct = chunk % ALIGN == 0 and _takes_o_direct(self.path)
        self.o_direct_writes = self.o_direct
        self._flags = _O_DIRECT if self.o_direct else 0

    def _map(self, fn, flags: int, threads: int) -> None:
        fd = os.open(self.path, flags | os.O_CLOEXEC | self._flags)
        try:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda i: fn(fd, i), range(self.count)))
        finally:
            os.close(fd)

    def _write_one(self, fd: int, i: int) -> None:
        view, done = self.host[i * self.chunk:(i + 1) * self.chunk], 0
        while done < self.chunk:
            done += os.pwritev(fd, [view[done:]], i * self.chunk + done)

    def _read_one(self, fd: int, i: int) -> None:
        view = self.host[i * self.chunk:(i + 1) * self.chunk]
        if os.preadv(fd, [view], i * self.chunk) != self.chunk:
            raise OSError(f"disk loop: read of chunk {i} was short")

    def write(self, rep: int) -> None:
        """Overwrite every chunk's range of the file from the host region (`rep` unused: the
        same blocks every pass)."""
        self._map(self._write_one, os.O_WRONLY, self.threads[1])

    def read(self, rep: int) -> None:
        """Read every chunk's range of the file back into the host region."""
        self._map(self._read_one, os.O_RDONLY, self.threads[0])

    def close(self) -> None:
        """Nothing to release (the file goes with the benchmark's folder)."""
