"""Model KV geometry: `KVCacheSpec` of `LayerGroup`s, element sizes, and `LayoutError` (DESIGN §3).

A `LayerGroup` describes layers that share one page geometry. Sizes are elements (head size,
latent size), bytes (extra bytes, Mamba state) or tokens (block size, sliding window), as each
field's name says. Every validation error names the field path, e.g.
`groups[1].head_size: must be a positive int, got 0`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

#: Bytes per element of each KV dtype name. Sources: IEEE 754-2008 binary16/binary32 (fp16 2 B,
#: fp32 4 B); bfloat16 is 16 bits (Google Brain float, as in torch.bfloat16); OCP "8-bit Floating
#: Point Specification (OFP8)" v1.0 for E4M3/E5M2 (1 B); E4M3FNUZ (1 B, no infinities, no negative
#: zero, exponent bias 8: torch.float8_e4m3fnuz, AMD MI300's fp8) is a format of its own. Names
#: follow vLLM's `--kv-cache-dtype` values (`fp8`, `fp8_e4m3`, `fp8_e5m2`) plus the torch-style
#: spellings.
ELEMENT_BYTES: dict[str, int] = {
    "bf16": 2, "bfloat16": 2,
    "fp16": 2, "float16": 2, "half": 2,
    "fp32": 4, "float32": 4, "float": 4,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_e4m3fnuz": 1,
}


#: Upper bounds of a geometry, far above any published model (the largest KV pages known: 128 KV
#: heads (MHA), 576-element MLA latents, 2048-token blocks, < 1000 layers) and low enough that
#: every byte offset of a chunk fits int64 and the per-page index arrays the mapper builds
#: (rows × components int64) stay below ~100 MB: rows per page = KV heads × tokens per page.
MAX_LAYERS = 1 << 16
MAX_PAGE_ROWS = 1 << 20
MAX_ROW_BYTES = 1 << 24
#: Bytes of one device block over all layers at TP = 1 (1 TiB).
MAX_BLOCK_BYTES = 1 << 40


class LayoutError(ValueError):
    """A geometry or layout that kvhal refuses, with the reason.

    Attributes:
        field: The offending field path (e.g. "groups[0].head_size"), or None.
        layer: The first global layer index of the offending layer group, or None.
        reason: The reason without location, for tables (e.g. the refusal matrix).
    """

    def __init__(self, message: str, *, field: str | None = None, layer: int | None = None,
                 reason: str | None = None):
        super().__init__(message)
        self.field = field
        self.layer = layer
        self.reason = reason or message


class Kind(enum.Enum):
    """What one layer group stores.

    FULL: full attention, K and V per KV head per token. SLIDING_WINDOW: the same pages, but the
    model only attends to the last `sliding_window` tokens (the page geometry is identical).
    MLA: one latent vector per token, shared by all heads, replicated on every TP rank.
    MAMBA: an opaque recurrent state per sequence, no token axis: a device block holds the state
    after the block's last token, a chunk the one state after the chunk's last token.
    """

    FULL = "full"
    SLIDING_WINDOW = "sliding_window"
    MLA = "mla"
    MAMBA = "mamba"


ATTENTION_KINDS = frozenset({Kind.FULL, Kind.SLIDING_WINDOW})


def _positive(value: object, path: str, *, zero_ok: bool = False) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and (
        value >= 0 if zero_ok else value > 0)
    if not ok:
        need = "a non-negative int" if zero_ok else "a positive int"
        raise LayoutError(f"{path}: must be {need}, got {value!r}", field=path)


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Layers sharing one page geometry.

    Attributes:
        kind: What the layers store (`Kind` or its value string).
        num_layers: Number of layers in the group (> 0).
        num_kv_heads: Total KV heads of the model (TP = 1). MLA and Mamba: must be 1.
        head_size: Elements per head for K (and for V). MLA: latent elements per token
            (kv_lora_rank + rope dim, e.g. 512 + 64). Mamba: must be 0.
        dtype: Element dtype name, a key of `ELEMENT_BYTES`.
        block_size: Tokens per device block (> 0). Mamba: tokens the block stands for.
        extra_bytes_per_token: Bytes stored per token per KV head after K‖V (MLA: after the
            latent), e.g. fp8 scales; part of every page (≥ 0). A model whose scales are per token
            for all heads together stores them with head 0's row.
        sliding_window: Window in tokens; required (> 0) for SLIDING_WINDOW, None otherwise.
        state_bytes: Mamba only: bytes of one layer's opaque state (> 0); 0 for other kinds.
    """

    kind: Kind
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str
    block_size: int
    extra_bytes_per_token: int = 0
    sliding_window: int | None = None
    state_bytes: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            try:
                object.__setattr__(self, "kind", Kind(self.kind))
            except ValueError:
                raise LayoutError(f"kind: unknown kind {self.kind!r}; accepted: "
                                  f"{', '.join(k.value for k in Kind)}", field="kind") from None

    def validate(self, path: str = "") -> None:
        """Raise `LayoutError` naming `path + field` if the group is impossible."""
        _positive(self.num_layers, f"{path}num_layers")
        _positive(self.block_size, f"{path}block_size")
        _positive(self.extra_bytes_per_token, f"{path}extra_bytes_per_token", zero_ok=True)
        if not isinstance(self.dtype, str) or self.dtype not in ELEMENT_BYTES:
            raise LayoutError(f"{path}dtype: unknown dtype {self.dtype!r}; accepted: "
                              f"{', '.join(ELEMENT_BYTES)}", field=f"{path}dtype")
        if self.kind is Kind.MAMBA:
            _positive(self.state_bytes, f"{path}state_bytes")
            if self.head_size != 0 or self.extra_bytes_per_token != 0:
                raise LayoutError(f"{path}head_size: a mamba group is an opaque state; "
                                  "head_size and extra_bytes_per_token must be 0",
                                  field=f"{path}head_size")
        else:
            _positive(self.head_size, f"{path}head_size")
            if self.state_bytes != 0:
                raise LayoutError(f"{path}state_bytes: only mamba groups have a state, got "
                                  f"{self.state_bytes!r}", field=f"{path}state_bytes")
        _positive(self.num_kv_heads, f"{path}num_kv_heads")
        if self.kind in (Kind.MLA, Kind.MAMBA) and self.num_kv_heads != 1:
            raise LayoutError(f"{path}num_kv_heads: a {self.kind.value} group has one shared "
                              f"page per token, must be 1, got {self.num_kv_heads}",
                              field=f"{path}num_kv_heads")
        if self.kind is Kind.SLIDING_WINDOW:
            _positive(self.sliding_window, f"{path}sliding_window")
        elif self.sliding_window is not None:
            raise LayoutError(f"{path}sliding_window: only sliding_window groups have a window, "
                              f"got {self.sliding_window!r}", field=f"{path}sliding_window")
        self._check_bounds(path)

    def _check_bounds(self, path: str) -> None:
        """Refuse a valid-typed group too large to map (see `MAX_LAYERS` and siblings)."""
        if self.num_layers > MAX_LAYERS:
            raise LayoutError(f"{path}num_layers: {self.num_layers} layers, at most {MAX_LAYERS}",
                              field=f"{path}num_layers")
        rows = self.num_kv_heads * self.tokens_per_page
        if rows > MAX_PAGE_ROWS:
            field = "block_size" if self.num_kv_heads == 1 else "num_kv_heads"
            raise LayoutError(f"{path}{field}: {self.num_kv_heads} KV heads × "
                              f"{self.tokens_per_page} tokens = {rows} rows per page, at most "
                              f"{MAX_PAGE_ROWS}", field=f"{path}{field}")
        for name, value in zip(("head_size", "extra_bytes_per_token", "state_bytes"),
                               (self.head_bytes, self.extra_bytes_per_token, self.state_bytes)):
            if value > MAX_ROW_BYTES:
                raise LayoutError(f"{path}{name}: {value} bytes per row, at most "
                                  f"{MAX_ROW_BYTES}", field=f"{path}{name}")

    @property
    def element_bytes(self) -> int:
        """Bytes per element of `dtype`."""
        return ELEMENT_BYTES[self.dtype]

    @property
    def head_bytes(self) -> int:
        """Bytes of one head's K (or V, or the MLA latent) for one token."""
        return self.head_size * self.element_bytes

    @property
    def component_bytes(self) -> tuple[int, ...]:
        """Bytes of each piece of one (head, token) row, in canonical order.

        Attention: (K, V, extra); MLA: (latent, extra); Mamba: (state,).
        """
        if self.kind is Kind.MAMBA:
            return (self.state_bytes,)
        if self.kind is Kind.MLA:
            return (self.head_bytes, self.extra_bytes_per_token)
        return (self.head_bytes, self.head_bytes, self.extra_bytes_per_token)

    @property
    def row_bytes(self) -> int:
        """Bytes of one (head, token) row: sum of `component_bytes`."""
        return sum(self.component_bytes)

    @property
    def tokens_per_page(self) -> int:
        """Token rows in one block's page: block_size, or 1 for Mamba (one state per block)."""
        return 1 if self.kind is Kind.MAMBA else self.block_size


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """A model's KV cache geometry: layer groups in the engine's layer order.

    Global layer index i counts through the groups in order (group 0's layers first). The spec
    validates on construction and is hashable (used as a cache key for precomputed mappings).

    Raises:
        LayoutError: an impossible field, named by its path (e.g. `groups[1].dtype`).
    """

    groups: tuple[LayerGroup, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.groups, (tuple, list)):
            raise LayoutError(f"groups: expected a sequence of LayerGroup, got {self.groups!r}",
                              field="groups")
        object.__setattr__(self, "groups", tuple(self.groups))
        if not self.groups:
            raise LayoutError("groups: a spec needs at least one layer group", field="groups")
        for i, group in enumerate(self.groups):
            if not isinstance(group, LayerGroup):
                raise LayoutError(f"groups[{i}]: expected a LayerGroup, got {group!r}",
                                  field=f"groups[{i}]")
            group.validate(f"groups[{i}].")
        block_bytes = sum(g.num_layers * g.num_kv_heads * g.tokens_per_page * g.row_bytes
                          for g in self.groups)
        if block_bytes > MAX_BLOCK_BYTES:
            raise LayoutError(f"groups: one block of all layers is {block_bytes} bytes, at most "
                              f"{MAX_BLOCK_BYTES}", field="groups")

    @property
    def num_layers(self) -> int:
        """Layers over all groups."""
        return sum(g.num_layers for g in self.groups)

    def first_layer(self, group_index: int) -> int:
        """Global index of the first layer of group `group_index`."""
        return sum(g.num_layers for g in self.groups[:group_index])


def attention_spec(*, num_layers: int, num_kv_heads: int, head_size: int, dtype: str,
                   block_size: int, extra_bytes_per_token: int = 0,
                   sliding_window: int | None = None) -> KVCacheSpec:
    """A one-group spec of full attention (or sliding window when `sliding_window` is set)."""
    kind = Kind.SLIDING_WINDOW if sliding_window is not None else Kind.FULL
    return KVCacheSpec((LayerGroup(kind, num_layers, num_kv_heads, head_size, dtype, block_size,
                                   extra_bytes_per_token, sliding_window),))


def mla_spec(*, num_layers: int, latent_size: int, dtype: str, block_size: int,
             extra_bytes_per_token: int = 0) -> KVCacheSpec:
    """A one-group MLA spec: `latent_size` elements per token (kv_lora_rank + rope dim)."""
    return KVCacheSpec((LayerGroup(Kind.MLA, num_layers, 1, latent_size, dtype, block_size,
                                   extra_bytes_per_token),))
