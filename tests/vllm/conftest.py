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


def prompt(seed: int, num_tokens: int = PROMPT_TOKENS) -> list[int]:
    """A seeded random prompt of `num_tokens` token ids in [3, 1024) (the tiny vocab)."""
    return np.random.default_rng(seed).integers(3, 1024, num_tokens).tolist()


def flip_last_byte(path: str) -> None:
    """Corrupt a file in place: invert its last byte (an fs chunk's last payload byte)."""
    with open(path, "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)[0]
        f.seek(-1, 2)
        f.write(bytes([last ^ 0xFF]))


def run_engines(tmp_path: Path, name: str, tp: int, engines: list[dict],
                model: str = "tiny") -> list[list]:
    """Run `engines` on a tiny model (`kvhal.integrations.vllm.runner.MODELS`) at TP size
    `tp`, each in a fresh process; return per-engine step results (see
    `kvhal.integrations.vllm.runner`)."""
    from kvhal.integrations.vllm.runner import run_scenario

    return run_scenario({"tp": tp, "model": model, "engines": engines}, workdir=tmp_path,
                        name=name, command=(sys.executable, str(RUNNER)))


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory) -> Path:
    """A temporary folder shared by the engines of one test module."""
    return tmp_path_factory.mktemp("vllm")
