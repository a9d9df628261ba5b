"""How the whole suite spreads over pytest-xdist workers (`pytest -n auto`).

Slow tests run first: the minutes-long real-vLLM modules start while every worker is busy, and
the thousands of quick tests (conformance) fill the gaps at the end, so no worker runs the last
vLLM modules alone while the other idles. Each module of `tests/vllm/` goes to one worker as a
whole: its tests share one run of its engines or server (module-scoped fixtures), which a module
split over two workers starts on both. Every other test is scheduled alone, as under xdist's
default `load` mode (which sent the suite's end out in large contiguous batches: one worker took
the vLLM modules one after another while the other finished). xdist's own `loadgroup` mode does
not group under pytest 9.2 (it renames `item._nodeid`, which pytest 9.2 no longer reads).
"""
from __future__ import annotations

import pytest

#: Node id prefix of the modules scheduled as one unit each.
GROUPED = "tests/vllm/"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under `-n` with xdist's default `--dist load`: xdist's loadscope scheduler with one
    unit per `GROUPED` module and one per other test, handed out in collection order (an
    explicit `--dist` is kept)."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False   # not largest unit first: slow tests first

    class ModulesOfVllm(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if path.startswith(GROUPED) else nodeid

    return ModulesOfVllm(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Slow tests first, otherwise in collection order (the sort is stable, so every xdist
    worker collects the same order, as xdist requires)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
