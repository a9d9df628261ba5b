"""`kvhal bench vllm`'s engine scripts (no engine runs here): which steps each engine takes."""
from __future__ import annotations

import subprocess
import sys

import pytest

from kvhal.integrations.harness.bench.vllm import MAX_CONTEXT_TOKENS, STEPS_PER_PROMPT, scenarios


@pytest.mark.parametrize("recompute", [True, False])
def test_writer_steps_per_prompt_with_and_without_the_recompute_row(recompute):
    prompts = {"p0": [3] * 256, "p1": [4] * 256}
    writer, reader = scenarios(prompts, "/fs", 4, recompute)
    steps = writer["engines"][0]["steps"]
    assert len(steps) == 1 + len(prompts) * STEPS_PER_PROMPT[recompute]
    for i, (name, tokens) in enumerate(prompts.items()):
        mine = steps[1 + i * STEPS_PER_PROMPT[recompute]:][:STEPS_PER_PROMPT[recompute]]
        salted = [s for s in mine if s.get("cache_salt") == "cold"]
        assert len(salted) == (1 if recompute else 0)
        store, floor, reset, host = mine[-4:]
        assert store["prompts"] == {name: tokens}
        assert floor["prompts"] == host["prompts"] == {name: tokens + [5]}
        assert reset == {"op": "reset"}
    assert [s["prompts"] for s in reader["engines"][0]["steps"][2:]] == [
        {n: t + [5]} for n, t in prompts.items()]


def test_a_context_longer_than_the_model_is_refused_before_anything_runs():
    # 10**9 tokens used to build the prompts first: 23 GB resident, then the OOM killer
    for tokens in (MAX_CONTEXT_TOKENS + 128, 128 * 10 ** 7):
        out = subprocess.run([sys.executable, "-m", "kvhal.cli", "bench", "vllm",
                              "--no-recompute", "--context-tokens", str(tokens)],
                             capture_output=True, text=True, timeout=120)
        assert (out.returncode, out.stdout) == (1, "")
        assert out.stderr == (f"kvhal bench: error: --context-tokens: at most 16256 (the demo "
                              f"model's 16384 positions less one block), got {tokens}\n")


def test_a_tmp_dir_that_is_not_a_folder_is_named(tmp_path):
    (tmp_path / "file").write_bytes(b"x")
    for path in (tmp_path / "missing", tmp_path / "file"):
        out = subprocess.run([sys.executable, "-m", "kvhal.cli", "bench", "vllm",
                              "--no-recompute", "--tmp-dir", str(path)],
                             capture_output=True, text=True, timeout=120)
        assert (out.returncode, out.stdout) == (1, "")
        assert out.stderr == f"kvhal bench: error: --tmp-dir: not a directory: {path}\n"
