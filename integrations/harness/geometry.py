"""Model geometry of a replay: full attention (layers × KV heads × head size × dtype) or MLA
(layers × latent elements × dtype).

Sizes and validation come from `kvhal.layout` (`attention_spec`, `mla_spec`, `chunk_layout`,
`ELEMENT_BYTES`); this module only adds named presets and maps layout errors onto the CLI
flags. Hit counts depend on capacities in chunks, so the geometry matters through the chunk's
byte size; the device layout and TP sharding come from the layout layer too.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable

from kvhal.layout import KVCacheSpec, LayoutError, attention_spec, chunk_layout, mla_spec

#: `kvhal.layout` field → the `kvhal replay` flag that sets it (full attention).
_FLAGS = {"num_layers": "--layers", "num_kv_heads": "--kv-heads", "head_size": "--head-size",
          "dtype": "--dtype"}
#: The same for MLA: `mla_spec` stores the latent size as the group's head_size.
_MLA_FLAGS = {"num_layers": "--layers", "head_size": "--latent-size", "dtype": "--dtype"}


class GeometryError(ValueError):
    """A geometry option is invalid; the message names the flag and the accepted values."""


def _spec(build: Callable[[], KVCacheSpec], flags: dict[str, str]) -> KVCacheSpec:
    """`build()`, with a `LayoutError`'s field path replaced by the flag that sets it."""
    try:
        return build()
    except LayoutError as exc:
        message = str(exc)
        for field, flag in flags.items():
            message = message.replace(f"groups[0].{field}", flag)
        raise GeometryError(message) from None


class _Sized:
    """What both geometries share: validated on construction, sizes from their `spec`."""

    __slots__ = ()
    #: "full" or "mla", as `as_dict` reports it.
    kind = ""

    def spec(self, block_size: int) -> KVCacheSpec:
        """The one-group `KVCacheSpec` with `block_size`-token device blocks."""
        raise NotImplementedError

    def __post_init__(self) -> None:
        self.spec(1)

    @property
    def bytes_per_token(self) -> int:
        """Canonical bytes of one token over all layers (`kvhal.layout.chunk_layout`)."""
        return chunk_layout(self.spec(1), 1).chunk_bytes

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields plus `kind` and `bytes_per_token`."""
        return {"kind": self.kind, **asdict(self), "bytes_per_token": self.bytes_per_token}


@dataclass(frozen=True, slots=True)
class Geometry(_Sized):
    """Full-attention KV geometry (validated by `kvhal.layout` on construction).

    Attributes:
        layers: Attention layers (one canonical page per layer per chunk).
        kv_heads: KV heads (total over TP ranks).
        head_size: Elements per head.
        dtype: A key of `kvhal.layout.ELEMENT_BYTES`.

    Raises:
        GeometryError: an invalid value, named by its flag (e.g. "--head-size: ...").
    """

    layers: int
    kv_heads: int
    head_size: int
    dtype: str

    kind = "full"
    #: Device layout when `--layout` is not given (vLLM's GPU layout).
    default_layout = "packed-hnd"

    def spec(self, block_size: int) -> KVCacheSpec:
        """The one-group `KVCacheSpec` with `block_size`-token device blocks."""
        return _spec(lambda: attention_spec(num_layers=self.layers, num_kv_heads=self.kv_heads,
                                            head_size=self.head_size, dtype=self.dtype,
                                            block_size=block_size), _FLAGS)

    @property
    def model_id(self) -> str:
        """The replay's model name in chunk namespaces (one per geometry)."""
        return f"kvhal-replay/{self.layers}x{self.kv_heads}x{self.head_size}"


@dataclass(frozen=True, slots=True)
class MlaGeometry(_Sized):
    """MLA geometry: one latent vector per token per layer, the same on every TP rank
    (`kvhal.layout.mla_spec`; validated on construction).

    Attributes:
        layers: MLA layers (one canonical `[chunk_token][latent]` page per layer per chunk).
        latent_size: Elements per token (DeepSeek-V2/V3: kv_lora_rank 512 + qk_rope_head_dim
            64 = 576, from their config.json on Hugging Face).
        dtype: A key of `kvhal.layout.ELEMENT_BYTES`.

    Raises:
        GeometryError: an invalid value, named by its flag (e.g. "--latent-size: ...").
    """

    layers: int
    latent_size: int
    dtype: str

    kind = "mla"
    #: Device layout when `--layout` is not given: vLLM's MLA cache, (num_blocks, T, latent).
    default_layout = "mla"

    def spec(self, block_size: int) -> KVCacheSpec:
        """The one-group MLA `KVCacheSpec` with `block_size`-token device blocks."""
        return _spec(lambda: mla_spec(num_layers=self.layers, latent_size=self.latent_size,
                                      dtype=self.dtype, block_size=block_size), _MLA_FLAGS)

    @property
    def model_id(self) -> str:
        """The replay's model name in chunk namespaces (one per geometry)."""
        return f"kvhal-replay/mla-{self.layers}x{self.latent_size}"



#: Latent elements per token of DeepSeek-V2/V3 (kv_lora_rank 512 + qk_rope_head_dim 64).
DEEPSEEK_LATENT = 576

#: Named geometries. `tiny` is 64 B/token (32 KiB per 512-token chunk), the geometry of
#: `kvhal bench replay`; the others are the public configs (config.json on Hugging Face: num_hidden_layers,
#: num_key_value_heads, head_dim or hidden_size/num_attention_heads, kv_lora_rank +
#: qk_rope_head_dim for MLA, torch_dtype).
PRESETS: dict[str, Geometry | MlaGeometry] = {
    "tiny": Geometry(1, 1, 16, "float16"),
    "llama-3.2-1b": Geometry(16, 8, 64, "bfloat16"),
    "qwen3-0.6b": Geometry(28, 8, 128, "bfloat16"),
    "llama-3.1-8b": Geometry(32, 8, 128, "bfloat16"),
    "mistral-7b": Geometry(32, 8, 128, "bfloat16"),
    "deepseek-v2-lite": MlaGeometry(27, DEEPSEEK_LATENT, "bfloat16"),
    "deepseek-v3": MlaGeometry(61, DEEPSEEK_LATENT, "bfloat16"),
}


def preset(name: str) -> Geometry | MlaGeometry:
    """The preset called `name`.

    Raises:
        GeometryError: unknown name; the message lists the presets.
    """
    if name not in PRESETS:
        raise GeometryError(f"--preset: must be one of {', '.join(PRESETS)}, got {name!r}")
    return PRESETS[name]
