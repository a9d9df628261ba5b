"""Fixtures the `kvhal proxy` tests share: recording backends and proxy processes, all
stopped at teardown."""
from __future__ import annotations

from contextlib import ExitStack

import pytest

from .servers import KVHAL, ProxyProcess, RecordingBackend


@pytest.fixture
def backend():
    """Factory of recording backends (`cls`, a RecordingBackend or any class with `stop()`),
    all stopped at teardown."""
    with ExitStack() as stack:
        def make(name: str, cls=RecordingBackend, **kw) -> RecordingBackend:
            made = cls(name, **kw)
            stack.callback(made.stop)
            return made
        yield make


@pytest.fixture
def proxy_process(tmp_path):
    """Factory: `proxy_process(log_stem, *args)` starts `kvhal proxy --port 0 *args`, its log
    in `tmp_path/<log_stem><n>.log`; all killed at teardown."""
    with ExitStack() as stack:
        count = 0

        def start(log_stem: str, *args: str) -> ProxyProcess:
            nonlocal count
            px = ProxyProcess([KVHAL, "proxy", "--port", "0", *args],
                              tmp_path / f"{log_stem}{count}.log")
            count += 1
            stack.callback(px.kill)
            return px
        yield start
