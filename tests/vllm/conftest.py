"""Fixtures of the real-vLLM tests: run scenarios in fresh processes (`engine_run.py`)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

RUNNER = Path(__file__).with_name("engine_run.py")
#: Tokens per prompt: 7 full 128-token chunks + 104 tokens (the partial tail is never stored).
PROMPT_TOKENS = 1000
#: Prompt tokens kvhal can serve: full chunks before the prompt's last token (7 × 128).
FULL_HIT = 896


def prompt(seed: int) -> list[int]:
    """A seeded random prompt of `PROMPT_TOKENS` token ids in [3, 1024) (the tiny vocab)."""
    return np.random.default_rng(seed).integers(3, 1024, PROMPT_TOKENS).tolist()


def run_engines(tmp_path: Path, name: str, tp: int, engines: list[dict],
                timeout_s: float = 600) -> list[list]:
    """Run `engines` (see engine_run.py) in a fresh process; return per-engine step results.

    Raises:
        AssertionError: the process failed (its stderr tail is in the message).
    """
    scenario, out = tmp_path / f"{name}.json", tmp_path / f"{name}.out.json"
    scenario.write_text(json.dumps({"tp": tp, "engines": engines}))
    proc = subprocess.run([sys.executable, str(RUNNER), str(scenario), str(out)],
                          capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())["engines"]


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory) -> Path:
    """A temporary folder shared by the engines of one test module."""
    return tmp_path_factory.mktemp("vllm")
