"""The fs tier's C chunk I/O (`tiers/fs/_chunkio.c`) against its Python path (`fileio.py`):
the same files, the same errors, with and without O_DIRECT."""
from __future__ import annotations

import errno
import os
import shutil

import numpy as np
import pytest

from kvhal.tiers.chunk_format import ALIGN, CorruptChunk, SizeMismatch
from kvhal.tiers.fs import fileio
from kvhal.tiers.fs.fileio import Scratch, probe_o_direct, read_chunk, write_chunk
from kvhal.tiers.fs.format import chunk_path

from .helpers import NAMESPACE, PassThroughOs, chunk_key, host_region, payload, temp_files

needs_c = pytest.mark.skipif(not fileio.FAST_IO, reason="kvhal.tiers.fs._chunkio was not "
                                "built (no C compiler at install time); the Python path runs")


@pytest.fixture
def ns_dir(tmp_path):
    for i in range(256):
        os.makedirs(tmp_path / "chunks" / f"{i:02x}", exist_ok=True)
    return str(tmp_path)


def _directs(folder: str) -> list[bool]:
    return [False] + ([True] if probe_o_direct(folder) else [])


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")),
                    reason="no C compiler here: the Python path is the one to test")
def test_the_extension_is_built_where_a_c_compiler_is():
    # setup.py builds it as optional: a machine with a compiler must not silently lose it
    assert fileio.FAST_IO


@needs_c
@pytest.mark.parametrize("nbytes", [ALIGN, 3 * ALIGN + 100, 5000, 1])
def test_c_and_python_paths_write_identical_files_and_read_each_other(ns_dir, nbytes):
    host, array = host_region(1 << 20)
    for direct in _directs(ns_dir):
        written = {}
        for name, osm in (("c", os), ("python", PassThroughOs())):
            key = chunk_key(NAMESPACE, 7)
            array[:nbytes] = payload(7, nbytes)
            write_chunk(osm, ns_dir, key, host[:nbytes], direct, Scratch(), sync=name == "c")
            with open(chunk_path(ns_dir, key), "rb") as f:
                written[name] = f.read()
            for reader in (os, PassThroughOs()):
                array[:] = 0
                read_chunk(reader, chunk_path(ns_dir, key), key, host[ALIGN:ALIGN + nbytes],
                           NAMESPACE, direct, Scratch())
                assert np.array_equal(array[ALIGN:ALIGN + nbytes], payload(7, nbytes))
        assert written["c"] == written["python"]
        assert len(written["c"]) % ALIGN == 0 and len(written["c"]) > nbytes
        assert temp_files(ns_dir) == []


def _both(fn):
    """Run `fn(osm)` with the C path and the Python path; return both exceptions."""
    out = []
    for osm in (os, PassThroughOs()):
        with pytest.raises(Exception) as info:
            fn(osm)
        out.append(info.value)
    return out


@needs_c
def test_read_errors_are_the_same_on_both_paths(ns_dir):
    host, array = host_region(1 << 20)
    key = chunk_key(NAMESPACE, 1)
    path = chunk_path(ns_dir, key)

    def read(osm, nbytes=5000):
        read_chunk(osm, path, key, host[:nbytes], NAMESPACE, False, Scratch())

    missing = _both(read)
    assert [type(e) for e in missing] == [FileNotFoundError] * 2
    assert [e.errno for e in missing] == [errno.ENOENT] * 2
    assert missing[0].filename == path

    os.mkfifo(path)
    fifo = _both(read)
    assert [type(e) for e in fifo] == [CorruptChunk] * 2
    assert str(fifo[0]) == str(fifo[1])
    assert str(fifo[0]).startswith("not a regular file (mode p")
    os.unlink(path)

    array[:5000] = payload(1, 5000)
    write_chunk(os, ns_dir, key, host[:5000], False, Scratch(), sync=False)
    other_size = _both(lambda osm: read(osm, 9000))
    assert [type(e) for e in other_size] == [SizeMismatch] * 2
    assert str(other_size[0]) == str(other_size[1])

    with open(path, "r+b") as f:
        f.truncate(2 * ALIGN)
    truncated = _both(read)
    assert [type(e) for e in truncated] == [CorruptChunk] * 2
    assert str(truncated[0]) == str(truncated[1]) == (
        f"file size {2 * ALIGN} != expected {3 * ALIGN}")


@needs_c
def test_a_failed_write_leaves_no_temp_file_on_both_paths(ns_dir):
    host, array = host_region(1 << 20)
    key = chunk_key(NAMESPACE, 2)
    os.makedirs(os.path.join(chunk_path(ns_dir, key), "in-the-way"))  # rename onto a folder
    errors = _both(lambda osm: write_chunk(osm, ns_dir, key, host[:ALIGN], False, Scratch(),
                                           sync=False))
    assert [e.errno for e in errors] == [errno.EISDIR] * 2
    assert temp_files(ns_dir) == []


@needs_c
def test_more_buffers_than_the_helper_takes_is_a_value_error(tmp_path):
    from kvhal.tiers.fs import _chunkio

    bufs = [bytearray(1)] * 5
    with pytest.raises(ValueError, match="bufs: at most 4 buffers, got 5"):
        _chunkio.write_file(str(tmp_path / "t"), str(tmp_path / "f"), bufs, False, False,
                            str(tmp_path))
    with pytest.raises(BufferError):
        _chunkio.read_file(str(tmp_path / "f"), [b"read-only"], False, 9)
    assert os.listdir(tmp_path) == []


@needs_c
def test_the_bound_hasher_is_xxh3_128_and_a_corrupt_payload_is_caught_in_c(ns_dir):
    import xxhash

    from kvhal.tiers.fs import _chunkio

    assert fileio.HASH_IN_C  # python-xxhash exports XXH3_128bits; binding it must work here
    for data in (b"", b"x", bytes(range(256)) * 4096, np.random.default_rng(3).bytes(300001)):
        assert _chunkio.xxh3_128(data) == xxhash.xxh3_128_digest(data)
    host, array = host_region(1 << 20)
    key = chunk_key(NAMESPACE, 9)
    array[:2 * ALIGN] = payload(9, 2 * ALIGN)
    write_chunk(os, ns_dir, key, host[:2 * ALIGN], False, Scratch(), sync=False)
    path = chunk_path(ns_dir, key)
    status, n, digest, file_id = _chunkio.read_file(
        path, [bytearray(ALIGN), host[ALIGN:3 * ALIGN]], False, 3 * ALIGN, 1)
    assert (status, n, digest) == (0, 3 * ALIGN, xxhash.xxh3_128_digest(payload(9, 2 * ALIGN)))
    st = os.stat(path)
    assert file_id == (st.st_dev, st.st_ino, st.st_ctime_ns)
    assert _chunkio.read_file(path, [bytearray(ALIGN), host[ALIGN:3 * ALIGN]], False,
                              3 * ALIGN)[2] is None  # not asked to verify
    with open(path, "r+b") as f:                     # one payload bit flipped
        f.seek(ALIGN + 5000)
        byte = f.read(1)
        f.seek(ALIGN + 5000)
        f.write(bytes([byte[0] ^ 1]))
    for osm in (os, PassThroughOs()):
        with pytest.raises(CorruptChunk, match="checksum mismatch"):
            read_chunk(osm, path, key, host[:2 * ALIGN], NAMESPACE, False, Scratch())


@needs_c
def test_a_sealed_write_is_the_header_encode_header_writes_and_bad_seals_are_refused(tmp_path):
    import xxhash

    from kvhal.tiers.chunk_format import (CHECKSUM_OFFSET, HEADER_BYTES, encode_header,
                                          encode_header_fields)
    from kvhal.tiers.fs import _chunkio

    for data in (b"", b"x", np.random.default_rng(4).bytes(70001)):
        assert _chunkio.xxh3_64(data) == xxhash.xxh3_64_intdigest(data)
    host, array = host_region(1 << 20)
    array[:4 * ALIGN] = payload(11, 4 * ALIGN)
    key = chunk_key(NAMESPACE, 11)
    expected = bytearray(HEADER_BYTES)
    encode_header(memoryview(expected), key, 4 * ALIGN,
                  xxhash.xxh3_128_digest(payload(11, 4 * ALIGN)))
    header = Scratch().header
    digest_at = encode_header_fields(header, key, 4 * ALIGN)
    final = tmp_path / "f"
    _chunkio.write_file(str(tmp_path / "t"), str(final), [header, host[:4 * ALIGN]], False,
                        False, str(tmp_path), CHECKSUM_OFFSET, digest_at)
    assert final.read_bytes() == bytes(expected) + payload(11, 4 * ALIGN).tobytes()
    huge = 2**63 - 1  # offset + 16 overflows: a bounds check that wraps reads out of bounds
    for offsets, match in (((HEADER_BYTES - 8, digest_at), "checksum_at=4088"),
                           ((CHECKSUM_OFFSET, HEADER_BYTES), "outside a header"),
                           ((huge, digest_at), f"checksum_at={huge},"),
                           ((huge - 10, digest_at), f"checksum_at={huge - 10},"),
                           ((CHECKSUM_OFFSET, huge), f"digest_at={huge}:"),
                           ((CHECKSUM_OFFSET, huge - 4), f"digest_at={huge - 4}:")):
        with pytest.raises(ValueError, match=match):
            _chunkio.write_file(str(tmp_path / "t"), str(final), [header, host[:ALIGN]], False,
                                False, str(tmp_path), *offsets)
    for bufs in ([header], [bytearray(0), host[:ALIGN], header], [header, bytearray(0)]):
        # an empty buffer is skipped: sealing would write into, or hash, another buffer
        with pytest.raises(ValueError, match="empty or missing header or payload buffer"):
            _chunkio.write_file(str(tmp_path / "t"), str(final), bufs, False, False,
                                str(tmp_path), CHECKSUM_OFFSET, digest_at)
    with pytest.raises(BufferError):                 # the header is written into
        _chunkio.write_file(str(tmp_path / "t"), str(final), [bytes(HEADER_BYTES), header],
                            False, False, str(tmp_path), CHECKSUM_OFFSET, digest_at)
    assert sorted(os.listdir(tmp_path)) == ["f"]


@needs_c
def test_a_batch_returns_each_jobs_error_and_still_runs_the_others(tmp_path):
    from kvhal.tiers.fs import _chunkio

    good, data = tmp_path / "good", bytes(range(256)) * 32
    outcomes = _chunkio.write_files([
        (str(tmp_path / "t1"), str(good), [data], False, False, str(tmp_path)),
        (str(tmp_path / "no" / "t2"), str(tmp_path / "no" / "f"), [data], False, False,
         str(tmp_path))])
    assert outcomes[0] is False
    assert isinstance(outcomes[1], FileNotFoundError)
    assert (outcomes[1].errno, outcomes[1].kvhal_step) == (errno.ENOENT, "open")
    assert good.read_bytes() == data

    into = [bytearray(len(data)), bytearray(len(data))]
    outcomes = _chunkio.read_files([(str(tmp_path / "missing"), [into[0]], False, len(data)),
                                    (str(good), [into[1]], False, len(data), 0)])
    assert isinstance(outcomes[0], FileNotFoundError) and outcomes[0].kvhal_step == "open"
    status, n, digest, file_id = outcomes[1]
    assert (status, n, digest) == (0, len(data), _chunkio.xxh3_128(data))
    assert file_id[1] == os.stat(good).st_ino
    assert bytes(into[1]) == data


@needs_c
def test_a_batch_with_refused_arguments_runs_no_job(tmp_path):
    from kvhal.tiers.fs import _chunkio

    fine = (str(tmp_path / "t1"), str(tmp_path / "f1"), [b"x" * 10], False, False,
            str(tmp_path))
    with pytest.raises(ValueError, match=r"^jobs\[1\]: bufs: at most 4 buffers, got 5"):
        _chunkio.write_files([fine, (str(tmp_path / "t2"), str(tmp_path / "f2"),
                                     [bytearray(1)] * 5, False, False, str(tmp_path))])
    with pytest.raises(TypeError, match=r"jobs\[1\]: an argument tuple, not list"):
        _chunkio.write_files([fine, list(fine)])
    with pytest.raises(TypeError, match=r"^jobs\[2\]: .*at least 6 arguments \(2 given\)"):
        _chunkio.write_files([fine, fine, fine[:2]])
    with pytest.raises(BufferError, match=r"^jobs\[1\]: "):
        _chunkio.read_files([(str(tmp_path / "f1"), [bytearray(10)], False, 10),
                             (str(tmp_path / "f1"), [b"read-only"], False, 10)])
    with pytest.raises(TypeError, match=r"^function takes at least 6"):   # one job: as called
        _chunkio.write_file(*fine[:2])
    assert os.listdir(tmp_path) == []
    assert _chunkio.write_files([]) == [] and _chunkio.read_files(()) == []


@needs_c
def test_a_batch_owns_its_jobs_while_the_callers_list_changes(tmp_path):
    # a path object's __fspath__ (run while the jobs are parsed) empties the caller's list: the
    # batch still runs every job it was given and names each one's own path
    from kvhal.tiers.fs import _chunkio

    buf = bytearray(ALIGN)
    jobs: list = []

    class ClearsTheList:
        def __fspath__(self):
            jobs.clear()
            return str(tmp_path / "none-0")

    jobs.append((ClearsTheList(), [buf], False, ALIGN))
    jobs.extend((str(tmp_path / f"none-{i}-{'z' * 100}"), [buf], False, ALIGN)
                for i in range(1, 64))
    outcomes = _chunkio.read_files(jobs)

    assert len(outcomes) == 64 and all(isinstance(o, FileNotFoundError) for o in outcomes)
    assert [o.filename for o in outcomes[1:]] == [str(tmp_path / f"none-{i}-{'z' * 100}")
                                                  for i in range(1, 64)]
