"""The `vllm-cuda` extra admits exactly the vLLM releases kvhal claims (`fetch.RELEASES`, each
checked against its own source by `test_releases.py`): a newer release, whose connector API
nothing here has checked, is refused by pip's resolver instead of installed unchecked."""
from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

from .fetch import RELEASES

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _vllm_requirement() -> Requirement:
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    (req,) = [r for r in map(Requirement, extras["vllm-cuda"]) if r.name == "vllm"]
    return req


def test_vllm_cuda_extra_admits_every_claimed_release_and_no_later_one():
    """Fails when the extra has no upper bound (seen with `vllm>=0.33`: 0.35.0 admitted), admits
    the release before the oldest claimed, or drops a claimed release."""
    spec = _vllm_requirement().specifier
    oldest, newest = min(map(Version, RELEASES)), max(map(Version, RELEASES))
    assert [v for v in RELEASES if not spec.contains(v)] == []
    assert not spec.contains(f"{newest.major}.{newest.minor + 1}.0")
    assert not spec.contains(f"{oldest.major}.{oldest.minor - 1}.0")
