"""The fs tier's C I/O path (`tiers/fs/_chunkio.c`, `fileio.FAST_IO`) under syscall-level
faults and sync counting: the path every store and load takes in production, which the
`os_module` injections of the other fs tests switch off.

A child process (`fs_c_path_child.py`) runs the tier with the real `os` module under
`strace` (Debian package `strace`): `-e inject=SYSCALL:error=ERRNO` makes the kernel-facing
calls fail as a faulty or full disk or a denied file would (EIO cannot be produced on demand
on this machine: no device-mapper), and `-e trace=fdatasync,fsync` records the syncs a store
makes. Skipped, with the reason, where the C helper is not built or strace is missing or may
not trace (no ptrace).
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvhal.tiers.fs import fileio

from .test_fs_power_loss import NBYTES

REPO = Path(__file__).resolve().parents[2]
COUNT = 5


def _strace(tmp_path: Path, strace_args: list[str], *child_args) -> tuple[dict, list[str]]:
    """Run the child under strace; returns its JSON report and strace's log lines."""
    if not fileio.FAST_IO:
        pytest.skip("the fs tier's C helper (_chunkio) is not built: no C path to test")
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed (Debian package strace)")
    log = tmp_path / "strace.log"
    root = tmp_path / "root"
    out = subprocess.run(
        ["strace", "-f", "-qq", "-o", str(log), *strace_args, sys.executable, "-m",
         "tests.tiers.fs_c_path_child", str(root), *map(str, child_args)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    if out.returncode != 0 and "PTRACE" in out.stderr.upper():
        pytest.skip(f"strace may not trace here: {out.stderr.strip()[:200]}")
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1]), log.read_text().splitlines()


@pytest.mark.parametrize("err", (errno.EIO, errno.EACCES, errno.ENOSPC),
                         ids=lambda e: errno.errorcode[e])
@pytest.mark.parametrize("direction", ["store", "load"])
def test_a_syscall_error_on_the_c_path_fails_each_job_once(tmp_path, direction, err):
    """Every pwritev (stores) or preadv (loads) fails with `err`: each job fails once,
    naming the errno; no key is a hit, no temp file stays behind.

    Fails when a failed write or read on the C path is reported done, or leaves its temp
    file: e.g. with `fileio.write_chunk` and `write_chunks` turning the C helper's OSError
    into False (a new file written), the 5 stores are reported ok.
    """
    calls = "pwritev,pwritev2" if direction == "store" else "preadv,preadv2"
    report, log = _strace(tmp_path, ["-e", f"trace={calls}", "-e",
                                     f"inject={calls}:error={errno.errorcode[err]}"],
                          "process", direction, COUNT, 1 << 20)

    assert report["fast_io"] is True
    assert sum("(INJECTED)" in line for line in log) >= COUNT
    assert report["results"] == [[False, f"{errno.errorcode[err]}: {os.strerror(err)}"]] * COUNT
    assert (report["lookups"], report["temps"]) == (["MISS"] * COUNT, [])


@pytest.mark.parametrize("durability, syncs", [
    ("process", []), ("power-loss", ["fdatasync", "fsync"])], ids=["process", "power-loss"])
def test_durability_decides_the_syncs_of_a_store_on_the_c_path(tmp_path, durability, syncs):
    """The C path's syncs of one store, read by strace between the child's markers: none by
    default, the temp file's fdatasync and the folder's fsync with "power-loss" (the same as
    `test_fs_power_loss.py` counts on the Python path).

    Fails when `durability` does not reach the C helper: e.g. with `write_chunk` passing
    `False` for `sync` to `_chunkio.write_file`, the power-loss store makes no sync.
    """
    report, log = _strace(tmp_path, ["-e", "trace=fdatasync,fsync,getppid"],
                          durability, "store", 1, NBYTES)

    assert (report["fast_io"], report["results"]) == (True, [[True, None]])
    calls = [line.split(None, 1)[1].split("(")[0] for line in log
             if "resumed>" not in line and "+++" not in line]
    start, end = (i for i, c in enumerate(calls) if c == "getppid")
    assert calls[start + 1:end] == syncs
