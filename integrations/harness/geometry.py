"""Model geometry of a replay: full-attention layers × KV heads × head size × dtype, TP 1.

Sizes and validation come from `kvhal.layout` (`attention_spec`, `ELEMENT_BYTES`); this module
only adds named presets and maps layout errors onto the CLI flags. Hit counts depend on
capacities in chunks, so the geometry matters through the chunk's byte size.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvhal.layout import KVCacheSpec, LayoutError, attention_spec, chunk_layout

#: `kvhal.layout` field → the `kvhal replay` flag that sets it.
_FLAGS = {"num_layers": "--layers", "num_kv_heads": "--kv-heads", "head_size": "--head-size",
          "dtype": "--dtype"}


class GeometryError(ValueError):
    """A geometry option is invalid; the message names the flag and the accepted values."""


@dataclass(frozen=True, slots=True)
class Geometry:
    """Full-attention KV geometry at TP 1 (validated by `kvhal.layout` on construction).

    Attributes:
        layers: Attention layers (one canonical page per layer per chunk).
        kv_heads: KV heads (total, TP 1).
        head_size: Elements per head.
        dtype: A key of `kvhal.layout.ELEMENT_BYTES`.

    Raises:
        GeometryError: an invalid value, named by its flag (e.g. "--head-size: ...").
    """

    layers: int
    kv_heads: int
    head_size: int
    dtype: str

    def __post_init__(self) -> None:
        self.spec(1)

    def spec(self, block_size: int) -> KVCacheSpec:
        """The one-group `KVCacheSpec` with `block_size`-token device blocks."""
        try:
            return attention_spec(num_layers=self.layers, num_kv_heads=self.kv_heads,
                                  head_size=self.head_size, dtype=self.dtype,
                                  block_size=block_size)
        except LayoutError as exc:
            message = str(exc)
            for field, flag in _FLAGS.items():
                message = message.replace(f"groups[0].{field}", flag)
            raise GeometryError(message) from None

    @property
    def bytes_per_token(self) -> int:
        """Canonical K and V bytes of one token over all layers."""
        return chunk_layout(self.spec(1), 1).chunk_bytes


#: Named geometries. `tiny` is 64 B/token (32 KiB per 512-token chunk), the issue-7 benchmark
#: geometry; the others are the public configs (config.json on Hugging Face: num_hidden_layers,
#: num_key_value_heads, head_dim or hidden_size/num_attention_heads, torch_dtype).
PRESETS = {
    "tiny": Geometry(1, 1, 16, "float16"),
    "llama-3.2-1b": Geometry(16, 8, 64, "bfloat16"),
    "qwen3-0.6b": Geometry(28, 8, 128, "bfloat16"),
    "llama-3.1-8b": Geometry(32, 8, 128, "bfloat16"),
    "mistral-7b": Geometry(32, 8, 128, "bfloat16"),
}


def preset(name: str) -> Geometry:
    """The preset called `name`.

    Raises:
        GeometryError: unknown name; the message lists the presets.
    """
    if name not in PRESETS:
        raise GeometryError(f"--preset: must be one of {', '.join(PRESETS)}, got {name!r}")
    return PRESETS[name]
