"""`kvhal bench vllm`'s engine scripts (no engine runs here): which steps each engine takes."""
from __future__ import annotations

import pytest

from kvhal.integrations.vllm.bench import STEPS_PER_PROMPT, scenarios


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
