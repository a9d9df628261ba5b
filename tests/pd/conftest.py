"""Fixtures the `kvhal proxy` tests share: recording backends and proxy processes, all
stopped at teardown."""
from __future__ import annotations

import pytest

from .servers import KVHAL, ProxyProcess, RecordingBackend


@pytest.fixture
def backend():
    """Factory of recording backends, all stopped at teardown."""
    made = []

    def make(name: str, cls=RecordingBackend, **kw) -> RecordingBackend:
        made.append(cls(name, **kw))
        return made[-1]
    yield make
    for b in made:
        b.stop()


@pytest.fixture
def proxy_process(tmp_path):
    """Factory: `proxy_process(log_stem, *args)` starts `kvhal proxy --port 0 *args`, its log
    in `tmp_path/<log_stem><n>.log`; all killed at teardown."""
    made = []

    def start(log_stem: str, *args: str) -> ProxyProcess:
        made.append(ProxyProcess([KVHAL, "proxy", "--port", "0", *args],
                                 tmp_path / f"{log_stem}{len(made)}.log"))
        return made[-1]
    yield start
    for p in made:
        p.kill()
