"""Layout: model geometry, device page layouts, the canonical page, copy plans (DESIGN §3).

Pure functions, no I/O. What other layers consume:

1. Geometry — `KVCacheSpec(groups=(LayerGroup(kind, num_layers, num_kv_heads, head_size,
   dtype, block_size, extra_bytes_per_token=0, sliding_window=None, state_bytes=0), ...))`;
   kinds `Kind.FULL | SLIDING_WINDOW | MLA | MAMBA`; element sizes in `ELEMENT_BYTES` (sources
   there). Bad fields raise `LayoutError` naming the field path (`groups[1].head_size: ...`).
   `extra_bytes_per_token` is per token *per KV head* (fp8 scales travel with their head).

2. Device layouts by name (`get_layout(name)`, registered through `kvhal_register_layouts`):
   packed-hnd, packed-nhd, split-nhd, split-hnd, separate-kv, vllm-cpu (attention); mla; mamba
   (opaque); `strided_layout(PageStrides(...))` for pages read off a tensor's strides (vLLM
   >= 0.33's `[B, H, N, C]` views, kernel blocks, heads a layer's blocks apart).
   `DeviceLayout.page_bytes(group, heads)` is one device block of one layer on one
   rank; `DeviceLayout.shape(group, heads, num_blocks)` the expected tensor shape.

3. Canonical format `FORMAT_ID = "kvhal-hnd-v1"`: one layer's chunk page is
   `[global_head][chunk_token][K ‖ V ‖ extra]` (MLA `[chunk_token][latent ‖ extra]`, Mamba
   `[state]`: the one state after the chunk's last token; it maps with blocks_per_chunk 1); extra bytes sit at the end of each (head, token) row. A chunk's host slot
   is every layer's page back to back in global layer order (`[group][layer][page]`, no padding;
   `chunk_layout(spec, N)`). `map_group(...)` gives one rank's coalesced `CopyRun`s and its
   writer flag (lowest rank of each replica set writes; MLA: rank 0); `verify_tiling(...)`
   proves coverage and single writers; unmappable combinations raise `LayoutError` naming the
   layer group and `.reason`; `mapping_status(...)` says canonical / replicated / refused.

4. Planning — `mapper = chunk_mapper(spec, layout, tp_size, tp_rank, blocks_per_chunk)` once
   per rank (cached); `dev = device_cache(mapper, layer_tensors)` once after
   `register_kv_caches`; then per chunk `plan_copies(mapper, block_ids, dev, host_slot_addr,
   "d2h" | "h2d") → CopyPlan` (vectorised; D2H carries only elected writers' bytes, H2D fills
   every replica).
"""
from .canonical import (FORMAT_ID, ChunkLayout, GroupMapping, RankShare, canonical_page_bytes,
                        check_spread, check_tiles, chunk_layout, coalesce, layouts_for,
                        map_group, mapping_status, rank_share, resolve_layout, run_fragments,
                        verify_tiling)
from .devices import (BUILTIN_LAYOUTS, DeviceLayout, PageStrides, default_layouts, get_layout,
                      strided_layout, tensor_element_bytes)
from .geometry import (ATTENTION_KINDS, ELEMENT_BYTES, Kind, KVCacheSpec, LayerGroup,
                       LayoutError, attention_spec, mla_spec)
from .mapper import (D2H, H2D, ChunkMapper, DeviceCache, chunk_mapper, device_cache, plan_copies,
                     plan_job_copies)
from .plan import CopyPlan, CopyRun

__all__ = [
    "ATTENTION_KINDS", "BUILTIN_LAYOUTS", "ChunkLayout", "ChunkMapper", "CopyPlan",
    "CopyRun", "D2H", "DeviceCache", "DeviceLayout", "ELEMENT_BYTES", "FORMAT_ID",
    "GroupMapping", "H2D", "KVCacheSpec", "Kind", "LayerGroup", "LayoutError", "PageStrides",
    "RankShare", "attention_spec", "canonical_page_bytes", "check_spread", "check_tiles",
    "chunk_layout", "chunk_mapper", "coalesce", "default_layouts", "device_cache", "get_layout",
    "layouts_for", "map_group", "mapping_status", "mla_spec", "plan_copies", "plan_job_copies",
    "rank_share", "resolve_layout", "run_fragments", "strided_layout", "tensor_element_bytes",
    "verify_tiling",
]
