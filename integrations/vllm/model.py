"""Tiny random-weight Llama models, built once with transformers and cached on disk.

vLLM loads them like any local checkpoint (`skip_tokenizer_init=True`, token-id prompts), so the
demo and the tests need no network and no download. Weights are seeded, so two builds of the
same `ModelSpec` are byte-identical.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

#: Env var overriding the cache folder (default `~/.cache/kvhal/models`).
CACHE_ENV = "KVHAL_MODEL_CACHE"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Geometry of a random Llama.

    Attributes:
        name: Folder name under the cache dir.
        hidden_size, num_layers, num_heads, num_kv_heads, vocab_size: Llama geometry
            (head size = hidden_size // num_heads).
        intermediate_size: MLP width.
        max_position: Longest context in tokens.
        seed: torch seed for the random weights.
    """

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    intermediate_size: int
    max_position: int = 16384
    seed: int = 0

    @property
    def head_size(self) -> int:
        """Elements per head."""
        return self.hidden_size // self.num_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """bf16 K and V bytes per token over all layers (at TP=1)."""
        return 2 * 2 * self.num_layers * self.num_kv_heads * self.head_size


#: For tests: engine start dominated by vLLM itself, prefill nearly free.
TINY = ModelSpec("kvhal-tiny-llama", hidden_size=256, num_layers=4, num_heads=4,
                 num_kv_heads=2, vocab_size=1024, intermediate_size=512)
#: For the demo and `kvhal bench vllm`: 8 KiB of KV per token, recompute clearly visible.
DEMO = ModelSpec("kvhal-demo-llama", hidden_size=1024, num_layers=8, num_heads=16,
                 num_kv_heads=4, vocab_size=4096, intermediate_size=2816)


def cache_dir() -> Path:
    """The folder holding built models (`$KVHAL_MODEL_CACHE` or `~/.cache/kvhal/models`)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kvhal" / "models")


def build_model(spec: ModelSpec, root: Path | None = None) -> Path:
    """Return the folder of `spec`'s checkpoint, building it on first use.

    The folder is complete once `kvhal-spec.json` exists (written last, after an atomic rename
    of the whole folder), so a crashed build is rebuilt, never half-used.

    Raises:
        ImportError: transformers or torch is not installed (install the `vllm` extra).
    """
    folder = (root or cache_dir()) / spec.name
    marker = folder / "kvhal-spec.json"
    if marker.exists() and json.loads(marker.read_text()) == asdict(spec):
        return folder
    import shutil
    import tempfile

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.parent.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
                         num_attention_heads=spec.num_heads,
                         num_key_value_heads=spec.num_kv_heads, vocab_size=spec.vocab_size,
                         intermediate_size=spec.intermediate_size,
                         max_position_embeddings=spec.max_position, torch_dtype="bfloat16",
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=folder.parent))
    model.save_pretrained(tmp)
    (tmp / "kvhal-spec.json").write_text(json.dumps(asdict(spec)))
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return folder
