"""The root conftest's xdist scheduler when a test kills its worker (a backend segfaulting,
`os._exit`): the run completes, the dead test is reported by name, every other test runs."""
from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: A conftest using the repository's own root conftest hooks (loaded from its file).
CONFTEST = f'''
import importlib.util

_spec = importlib.util.spec_from_file_location("kvhal_root_conftest", {str(REPO / "conftest.py")!r})
_root = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_root)
pytest_xdist_make_scheduler = _root.pytest_xdist_make_scheduler
pytest_collection_modifyitems = _root.pytest_collection_modifyitems
'''

SINGLE = '''
import ctypes
import os


def test_a(): pass
def test_b(): pass
def test_exits(): os._exit(1)
def test_c(): pass
def test_segfaults(): ctypes.string_at(0)
def test_d(): pass
def test_e(): pass
'''

#: Under tests/vllm/: scheduled as one unit, so the tests after the crash are the dead
#: worker's unfinished work.
GROUPED = '''
import os


def test_first(): pass
def test_dies(): os._exit(3)
def test_after_1(): pass
def test_after_2(): pass
'''


def test_crashed_worker_is_reported_by_test_and_the_run_completes(tmp_path):
    """Fails when the scheduler cannot lose a worker: xdist's loadscope scheduler queues the
    dead test again and waits forever for a collection count the dead worker no longer
    adds (seen: the run hangs after "replacing crashed worker"), or stops with
    `INTERNALERROR KeyError: <WorkerController gw…>`."""
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_single.py").write_text(textwrap.dedent(SINGLE))
    (tmp_path / "tests" / "vllm").mkdir(parents=True)
    (tmp_path / "tests" / "vllm" / "test_grouped.py").write_text(textwrap.dedent(GROUPED))

    out = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-q", "-rA",
                          "-p", "no:cacheprovider"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=180)

    text = out.stdout + out.stderr
    assert out.returncode == 1, text[-3000:]
    assert "INTERNALERROR" not in text, text[-3000:]
    for dead in ("test_single.py::test_exits", "test_single.py::test_segfaults",
                 "tests/vllm/test_grouped.py::test_dies"):
        assert f"FAILED {dead} - worker 'gw" in text, text[-3000:]
        assert re.search(rf"worker 'gw\d+' crashed while running '{re.escape(dead)}'", text)
    # warnings: pytest's own cleanup of an earlier run's temp folders may warn
    assert re.search(r"^=* ?3 failed, 8 passed(, \d+ warnings?)? in ",
                     out.stdout.splitlines()[-1]), text[-3000:]
    for alive in ("test_a", "test_b", "test_c", "test_d", "test_e"):
        assert f"PASSED test_single.py::{alive}" in text
    for alive in ("test_first", "test_after_1", "test_after_2"):
        assert f"PASSED tests/vllm/test_grouped.py::{alive}" in text

