"""Device layouts: how one TP rank stores its share of one layer's block on the accelerator.

A `DeviceLayout` is a named descriptor. Its `offsets` function places every piece of the rank's
logical page — indexed by (local head, token, component), components as in
`LayerGroup.component_bytes` — at a byte offset inside the rank's device page; everything else
(canonical offsets, coalescing, TP split, writer election) is computed generically from that, so
adding a layout is one `DeviceLayout` returned from a `kvhal_register_layouts` hook.

Shapes below are the physical (contiguous) order of the per-layer tensor, `heads` = KV heads on
this rank, `T` = block_size tokens, `D` = head_size (MLA: latent size) elements. When the group
has extra bytes per token (fp8 scales), the tensor is uint8 and its last dim is the row's bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .geometry import ATTENTION_KINDS, MAX_PAGE_ROWS, Kind, LayerGroup, LayoutError

OffsetsFn = Callable[[LayerGroup, int], np.ndarray]
ShapeFn = Callable[[LayerGroup, int, int], tuple]


@dataclass(frozen=True, slots=True)
class DeviceLayout:
    """A named device page layout.

    Attributes:
        name: Registry name (e.g. "packed-hnd").
        kinds: Group kinds it can store.
        description: The tensor shape and the order inside a page, for people.
        offsets: `offsets(group, heads)` → int64 array of shape (heads, tokens_per_page,
            len(group.component_bytes)): the byte offset of each piece in the rank's page. For
            two-plane layouts the page is the virtual concatenation [plane 0 page][plane 1 page].
        shape: `shape(group, heads, num_blocks)` → the per-layer tensor's physical shape, in
            elements of `tensor_element_bytes(group)`.
        num_planes: 1, or 2 when K and V live in separate planes of the tensor (`separate-kv`):
            plane p of block b is at `base + p * plane_stride + b * block_stride`.
        supports_extra_bytes: False if the layout has no place for per-token extra bytes.
        strides: None for the named dense layouts; the byte strides of a layout read off a
            tensor's strides (`strided_layout`), whose page need not be dense.
    """

    name: str
    kinds: frozenset
    description: str
    offsets: OffsetsFn = field(compare=False)   # the name (and strides) tell layouts apart
    shape: ShapeFn = field(compare=False)
    num_planes: int = 1
    supports_extra_bytes: bool = False
    strides: "PageStrides | None" = None

    def page_bytes(self, group: LayerGroup, heads: int) -> int:
        """Bytes of one rank's device page: one layer, one block, `heads` local KV heads (the
        bytes a block's copies move; a strided page spreads them over `plane_bytes`)."""
        return heads * group.tokens_per_page * group.row_bytes

    def plane_bytes(self, group: LayerGroup, heads: int) -> int:
        """Bytes of one plane of one block's page (= `page_bytes` for one-plane layouts); for
        a strided layout, the span from the page's first byte past its last one."""
        if self.strides is not None:
            return self.strides.extent(group, heads)
        return self.page_bytes(group, heads) // self.num_planes


def tensor_element_bytes(group: LayerGroup) -> int:
    """Element size of the per-layer tensor: 1 (uint8) with extra bytes or for Mamba, else the
    dtype's size."""
    if group.kind is Kind.MAMBA or group.extra_bytes_per_token:
        return 1
    return group.element_bytes


def _grid(group: LayerGroup, heads: int):
    """Index arrays h, t, c broadcastable to (heads, tokens, components), component offsets
    inside a canonical row, the head bytes and the row bytes."""
    sizes = np.asarray(group.component_bytes, dtype=np.int64)
    h = np.arange(heads, dtype=np.int64)[:, None, None]
    t = np.arange(group.tokens_per_page, dtype=np.int64)[None, :, None]
    c = np.arange(len(sizes), dtype=np.int64)[None, None, :]
    comp = (np.cumsum(sizes) - sizes)[None, None, :]
    return h, t, c, comp, group.head_bytes, group.row_bytes


def _full(arr: np.ndarray, group: LayerGroup, heads: int) -> np.ndarray:
    shape = (heads, group.tokens_per_page, len(group.component_bytes))
    return np.broadcast_to(arr, shape).astype(np.int64)


def _row_dim(group: LayerGroup, elements: int) -> int:
    return group.row_bytes if group.extra_bytes_per_token else elements


def _packed_hnd(g, heads):
    h, t, c, comp, hb, row = _grid(g, heads)
    return _full(h * g.block_size * row + t * row + comp, g, heads)


def _packed_nhd(g, heads):
    h, t, c, comp, hb, row = _grid(g, heads)
    return _full(t * heads * row + h * row + comp, g, heads)


def _split_nhd(g, heads):
    h, t, c, comp, hb, row = _grid(g, heads)
    return _full(c * g.block_size * heads * hb + t * heads * hb + h * hb, g, heads)


def _split_hnd(g, heads):
    h, t, c, comp, hb, row = _grid(g, heads)
    return _full(c * heads * g.block_size * hb + h * g.block_size * hb + t * hb, g, heads)


def _vllm_cpu(g, heads):
    h, t, c, comp, hb, row = _grid(g, heads)
    return _full(h * 2 * g.block_size * hb + c * g.block_size * hb + t * hb, g, heads)


def _mla(g, heads):
    h, t, c, comp, hb, row = _grid(g, heads)
    return _full(t * row + comp, g, heads)


def _mamba(g, heads):
    return np.zeros((1, 1, 1), dtype=np.int64)


_ATTN = frozenset(ATTENTION_KINDS)

#: The built-in layouts, registered by `kvhal.layout.plugin`.
BUILTIN_LAYOUTS: tuple[DeviceLayout, ...] = (
    DeviceLayout(
        "packed-hnd", _ATTN,
        "(num_blocks, heads, T, 2*D): per (block, head) T rows of K‖V‖extra; vLLM's packed GPU "
        "layout with HND strides; at TP=1 a block page equals the canonical page",
        _packed_hnd,
        lambda g, heads, nb: (nb, heads, g.block_size, _row_dim(g, 2 * g.head_size)),
        supports_extra_bytes=True),
    DeviceLayout(
        "packed-nhd", _ATTN,
        "(num_blocks, T, heads, 2*D): per (block, token) one K‖V‖extra row per head; vLLM's "
        "packed GPU layout with NHD strides",
        _packed_nhd,
        lambda g, heads, nb: (nb, g.block_size, heads, _row_dim(g, 2 * g.head_size)),
        supports_extra_bytes=True),
    DeviceLayout(
        "split-nhd", _ATTN,
        "(num_blocks, 2, T, heads, D): a K plane then a V plane per block, token-major",
        _split_nhd,
        lambda g, heads, nb: (nb, 2, g.block_size, heads, g.head_size)),
    DeviceLayout(
        "split-hnd", _ATTN,
        "(num_blocks, 2, heads, T, D): a K plane then a V plane per block, head-major",
        _split_hnd,
        lambda g, heads, nb: (nb, 2, heads, g.block_size, g.head_size)),
    DeviceLayout(
        "separate-kv", _ATTN,
        "(2, num_blocks, T, heads, D): legacy separate K and V tensors (two planes), NHD",
        _split_nhd,
        lambda g, heads, nb: (2, nb, g.block_size, heads, g.head_size),
        num_planes=2),
    DeviceLayout(
        "vllm-cpu", _ATTN,
        "(num_blocks, heads, T, 2*D) as registered by vLLM's CPU attention backend (block size "
        "128 there), but each (block, head) tile holds all T K rows, then all T V rows "
        "(REFERENCE.md, measured on vLLM-CPU 0.32)",
        _vllm_cpu,
        lambda g, heads, nb: (nb, heads, g.block_size, 2 * g.head_size)),
    DeviceLayout(
        "mla", frozenset({Kind.MLA}),
        "(num_blocks, T, D): one latent‖extra row per token, identical on every rank",
        _mla,
        lambda g, heads, nb: (nb, g.block_size, _row_dim(g, g.head_size)),
        supports_extra_bytes=True),
    DeviceLayout(
        "mamba", frozenset({Kind.MAMBA}),
        "(num_blocks, state_bytes) uint8: one opaque state per block slot, copied verbatim",
        _mamba,
        lambda g, heads, nb: (nb, g.state_bytes)),
)


@dataclass(frozen=True, slots=True)
class PageStrides:
    """Where the rows of one device block's page sit, as byte strides from the block's start.

    vLLM >= 0.33 hands every attention and MLA layer a `[B, H, N, C]` view (`C` = one (head,
    token) row: K then V, or the MLA latent) in one of several memory orders, with a vLLM block
    of T tokens cut into T / N kernel blocks (`B = num_blocks * T / N`;
    `vllm.v1.kv_cache_interface.create_kv_cache_views`). Row r of head h, token t of a vLLM
    block starts at `(t // N) * kernel_stride + h * head_stride + (t % N) * token_stride`; each
    row is contiguous. The page need not be dense: heads may be a whole layer's blocks apart
    (vLLM's LHBNC) or a block's other layers apart (BHLNC).

    Attributes:
        kernel_tokens: Tokens per kernel block (N), dividing the group's block size.
        kernel_stride: Bytes between the kernel blocks of one vLLM block (0 when N = T).
        head_stride: Bytes between a token's rows of consecutive local heads.
        token_stride: Bytes between consecutive tokens' rows of one head in a kernel block.
    """

    kernel_tokens: int
    kernel_stride: int
    head_stride: int
    token_stride: int

    def kernels(self, group: LayerGroup) -> int:
        """Kernel blocks per vLLM block (T / N)."""
        return group.tokens_per_page // self.kernel_tokens

    def offsets(self, group: LayerGroup, heads: int) -> np.ndarray:
        """`DeviceLayout.offsets` of this page (see the class docstring)."""
        h, t, c, comp, hb, row = _grid(group, heads)
        n = self.kernel_tokens
        return _full((t // n) * self.kernel_stride + h * self.head_stride
                     + (t % n) * self.token_stride + comp, group, heads)

    def shape(self, group: LayerGroup, heads: int, num_blocks: int) -> tuple:
        """The `[B, H, N, C]` view of `num_blocks` vLLM blocks, C in elements."""
        return (num_blocks * self.kernels(group), heads, self.kernel_tokens,
                _row_dim(group, group.row_bytes // group.element_bytes))

    def extent(self, group: LayerGroup, heads: int) -> int:
        """Bytes from a block's first row to the end of its last one."""
        return ((self.kernels(group) - 1) * self.kernel_stride + (heads - 1) * self.head_stride
                + (self.kernel_tokens - 1) * self.token_stride + group.row_bytes)


#: Largest stride a strided page may have (256 TiB), far above any device's memory, so every
#: offset of a page fits int64 (`MAX_STRIDE * MAX_PAGE_ROWS` < 2**63).
MAX_STRIDE = 1 << 48


def strided_layout(strides: PageStrides) -> DeviceLayout:
    """The device layout of pages placed by `strides` (attention and MLA groups), equal and
    hashing equal for equal strides (`map_group` caches by it). numpy integers are taken as
    Python ints (no fixed-width arithmetic).

    Raises:
        LayoutError: a stride or token count that is not an int in [0, MAX_STRIDE] (kernel
            tokens: [1, MAX_PAGE_ROWS]).
    """
    values = []
    for name in ("kernel_tokens", "kernel_stride", "head_stride", "token_stride"):
        value = getattr(strides, name)
        low, high = (1, MAX_PAGE_ROWS) if name == "kernel_tokens" else (0, MAX_STRIDE)
        if (not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_))
                or not low <= value <= high):
            raise LayoutError(f"strides.{name}: must be an int in [{low}, {high}], got "
                              f"{value!r}", field=f"strides.{name}")
        values.append(int(value))
    strides = PageStrides(*values)
    name = (f"strided(N={strides.kernel_tokens}@{strides.kernel_stride},"
            f"H@{strides.head_stride},T@{strides.token_stride})")
    return DeviceLayout(
        name, _ATTN | {Kind.MLA},
        "[B, H, N, C] view of vLLM >= 0.33 with the byte strides in its name: a row of K‖V "
        "(MLA: the latent) per (head, token), kernel blocks of N tokens",
        strides.offsets, strides.shape, supports_extra_bytes=True, strides=strides)


def get_layout(name: str) -> DeviceLayout:
    """The registered layout called `name` (built-ins and plugins).

    Raises:
        LayoutError: no layout of that name; the message lists the registered ones.
    """
    from kvhal import plugins

    found = plugins.layouts()
    if name not in found:
        raise LayoutError(f"layout: unknown layout {name!r}; registered: "
                          f"{', '.join(found) or 'none'}", field="layout")
    return found[name]


def default_layouts(spec_groups, attention_layout: str) -> tuple[str, ...]:
    """One layout name per group: `attention_layout` for attention groups, "mla" for MLA
    groups, "mamba" for Mamba groups."""
    names = {Kind.MLA: "mla", Kind.MAMBA: "mamba"}
    return tuple(names.get(g.kind, attention_layout) for g in spec_groups)
