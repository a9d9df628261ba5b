"""The conformance suite runs for a backend author who installed only `kvhal[dev]`."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: The modules of the `s3`, `p2p` and `vllm` extras, made unimportable in the child.
BLOCKED = ("obstore", "boto3", "msgpack", "zmq", "vllm")

#: A `sitecustomize` that makes every `BLOCKED` module raise ModuleNotFoundError on import,
#: as in an environment where those extras were never installed.
IMPORT_BLOCKER = f'''
import sys


class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {BLOCKED!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, _NotInstalled())
'''


@pytest.mark.slow  # a pytest run of its own: 15 s idle, 90 s on 2 loaded cores
def test_conformance_suite_runs_without_the_s3_p2p_and_vllm_extras(tmp_path):
    """`pytest conformance/ --kvhal-backend=cpu` with obstore, boto3, msgpack, zmq and vllm
    unimportable: conftest.py and every module load, the fs and memory tiers' tests pass and
    the obj and p2p tiers' tests skip naming their extra.

    The extras are removed by an import blocker (a `sitecustomize` on PYTHONPATH, so the
    suite's own child processes are blocked too) rather than by a fresh venv holding only
    `kvhal[dev]`: same imports seen, seconds instead of minutes of pip. Every module is
    collected; the run is the tier tests (the ones that need extras) without the slow
    multi-process ones.

    Fails when a conformance module imports an extra at load: e.g. with `conformance/s3.py`
    importing `kvhal.tiers.obj.local_server` at its top again (conftest.py then stops with
    "No module named 'obstore'"), or with the `extra` of the obj harness removed (its tests
    then fail instead of skipping).
    """
    (tmp_path / "sitecustomize.py").write_text(IMPORT_BLOCKER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tmp_path)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         "-rs", str(REPO / "conformance"), "--kvhal-backend=cpu", "-k",
         "tier and not processes"], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=600)

    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "the obj tier needs the s3 extra (obstore missing): pip install 'kvhal[s3]'" in text
    assert "the p2p tier needs the p2p extra (msgpack missing): pip install 'kvhal[p2p]'" in text
    passed = int(re.search(r"(\d+) passed", text).group(1))
    assert passed >= 30, text[-2000:]  # the fs and memory tiers' tests ran
    assert " failed" not in text and " error" not in text
