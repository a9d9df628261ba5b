"""Which conformance suites `--kvhal-backend` and `--kvhal-tier` select (collection only)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _collected(*options: str) -> list[str]:
    """Node ids `pytest conformance/ --collect-only` keeps under `options`."""
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only",
                          "-p", "no:cacheprovider", "-p", "no:xdist", "conformance", *options],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return [line for line in out.stdout.splitlines() if "::" in line]


@pytest.fixture(scope="module")
def everything() -> list[str]:
    return _collected()


def _is_tier(node: str) -> bool:
    return node.startswith("conformance/test_tier_")


def _functions(nodes) -> set[str]:
    """The test functions of `nodes`, parametrization dropped."""
    return {n.split("[", 1)[0] for n in nodes}


def test_backend_option_alone_runs_the_backend_and_layout_suites_only(everything):
    """Fails when the tier suite is collected under `--kvhal-backend` (its tests never touch
    the backend and skip asking a backend author for tier extras)."""
    nodes = _collected("--kvhal-backend=cpu")

    assert [n for n in nodes if _is_tier(n)] == []
    assert {n.split("::")[0] for n in nodes} == {
        "conformance/test_hal_copies.py", "conformance/test_hal_errors.py",
        "conformance/test_hal_memory.py", "conformance/test_hal_streams.py",
        "conformance/test_layout_roundtrip.py"}
    assert _functions(nodes) == _functions(n for n in everything if not _is_tier(n))


def test_tier_option_alone_runs_the_tier_suite_only(everything):
    nodes = _collected("--kvhal-tier=memory")

    assert nodes and all(_is_tier(n) and "memory" in n for n in nodes)
    assert _functions(nodes) == _functions(n for n in everything if _is_tier(n))


def test_no_option_and_both_options_run_both_suites(everything):
    both = _collected("--kvhal-backend=cpu", "--kvhal-tier=memory")

    assert any(_is_tier(n) for n in everything) and any(not _is_tier(n) for n in everything)
    assert any(_is_tier(n) for n in both) and any(not _is_tier(n) for n in both)
