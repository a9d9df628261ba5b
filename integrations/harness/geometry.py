"""Model geometry for a replay: how many KV bytes one token costs, and named presets.

Only the byte size of a chunk matters to a replay (hit counts depend on capacities measured in
chunks), so a geometry is full-attention layers × KV heads × head size × dtype, TP 1.
"""
from __future__ import annotations

from dataclasses import dataclass

#: Bytes per element of the KV dtypes a replay accepts.
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "float8_e4m3fn": 1,
               "float8_e5m2": 1}


class GeometryError(ValueError):
    """A geometry option is invalid; the message names the option and the accepted values."""


@dataclass(frozen=True, slots=True)
class Geometry:
    """Full-attention KV geometry at TP 1.

    Attributes:
        layers: Attention layers (one page per layer per chunk).
        kv_heads: KV heads (total, TP 1).
        head_size: Elements per head.
        dtype: Key of `DTYPE_BYTES`.
    """

    layers: int
    kv_heads: int
    head_size: int
    dtype: str

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise GeometryError(f"--{name.replace('_', '-')}: must be a positive integer, "
                                    f"got {v!r}")
        if self.dtype not in DTYPE_BYTES:
            raise GeometryError(f"--dtype: must be one of {', '.join(DTYPE_BYTES)}, "
                                f"got {self.dtype!r}")

    @property
    def page_bytes_per_token(self) -> int:
        """K and V bytes of one token in one layer."""
        return 2 * self.kv_heads * self.head_size * DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token over all layers."""
        return self.layers * self.page_bytes_per_token


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
