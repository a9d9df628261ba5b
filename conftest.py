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
    explicit `--dist` is kept).

    A worker that dies mid-test (a segfault, `os._exit`, a backend killing its process) costs
    that one test: xdist reports it as failed ("worker 'gw1' crashed while running '<test>'"),
    the rest of the dead worker's tests go back to the queue, and the replacement worker takes
    work once it has collected. Two workers dying at once cost one test each.
    """
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False   # not largest unit first: slow tests first

    class ModulesOfVllm(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if path.startswith(GROUPED) else nodeid

        def remove_node(self, node) -> str | None:
            """Forget `node`; return the test it died in (None if it had none left). That
            test is not queued again (it would kill the next worker too); the node's other
            unfinished tests are."""
            workload = self.assigned_work.pop(node)
            crashed = next((nodeid for unit in workload.values()
                            for nodeid, done in unit.items() if not done), None)
            if crashed is None:
                return None
            for scope, unit in workload.items():
                unit.pop(crashed, None)
                if not all(unit.values()):
                    self.workqueue[scope] = unit
            for other in self.nodes:
                self._reschedule(other)
            return crashed

        def _reschedule(self, node) -> None:
            # a replacement worker gets work once its collection is in (`schedule`)
            if node in self.registered_collections:
                super()._reschedule(node)

        def _assign_work_unit(self, node) -> None:
            # a worker can die before the node-down of another worker reaches it (two crashes
            # at once): the unit goes back to the front of the queue for the survivors
            scope = next(iter(self.workqueue))
            try:
                super()._assign_work_unit(node)
            except OSError:
                self.workqueue[scope] = self.assigned_work[node].pop(scope)
                self.workqueue.move_to_end(scope, last=False)

        def mark_test_complete(self, node, item_index: int, duration: float = 0) -> None:
            if node in self.assigned_work:  # not a late report of a worker already gone
                super().mark_test_complete(node, item_index, duration)

    return ModulesOfVllm(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Slow tests first, otherwise in collection order (the sort is stable, so every xdist
    worker collects the same order, as xdist requires)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
