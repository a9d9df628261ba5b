"""Fixtures of the real-vLLM tests: scenarios run in fresh processes (`engine_run.py`)."""
from __future__ import annotations

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


def run_engines(tmp_path: Path, name: str, tp: int, engines: list[dict]) -> list[list]:
    """Run `engines` on the tiny model at TP size `tp` in a fresh process; return per-engine
    step results (see `kvhal.integrations.vllm.runner`)."""
    from kvhal.integrations.vllm.runner import run_scenario

    return run_scenario({"tp": tp, "model": "tiny", "engines": engines}, workdir=tmp_path,
                        name=name, command=(sys.executable, str(RUNNER)))


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory) -> Path:
    """A temporary folder shared by the engines of one test module."""
    return tmp_path_factory.mktemp("vllm")
