"""Layout conformance: device pages → canonical host pages → device pages, through the backend.

For seeded random logical KV and every TP size × registered layout × model kind × chunk size:
scatter the KV into each rank's device pages (independent numpy oracle), run the D2H plans
through the backend into a pinned host slot and assert the slot equals the one canonical chunk
(so host bytes are identical across every TP size and layout); then load that slot (H2D) into a
different TP size and layout and assert every device byte is what the oracle says (chunk blocks
replaced, every other block untouched), with short strided runs issued as 2D copies or, for
half the cases, expanded into the batch (`expand_up_to`). Unmappable combinations must be
refused, and exactly those of `MAPPED_BY` (the built-in layouts): a layout refused by mistake
fails its case instead of passing as a refusal.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from kvhal import plugins
from kvhal.hal import host_array
from kvhal.layout import (D2H, H2D, Kind, KVCacheSpec, LayerGroup, LayoutError,
                          attention_spec, chunk_mapper, mapping_status, mla_spec, plan_copies)

from .layout_oracle import (canonical_chunk, canonical_mismatch, device_mismatch, download,
                            free_device, logical_kv, make_rank_device, place_chunk, run_plan,
                            upload)

TP_SIZES = (1, 2, 4, 8)
BLOCKS_PER_CHUNK = (1, 4)

#: Small geometries (few layers, small heads, few tokens): the combinatorics is the point.
KINDS = {
    "mha32": attention_spec(num_layers=2, num_kv_heads=32, head_size=2, dtype="bf16",
                            block_size=4),
    "gqa8": attention_spec(num_layers=2, num_kv_heads=8, head_size=8, dtype="fp16",
                           block_size=4),
    "mqa1": attention_spec(num_layers=2, num_kv_heads=1, head_size=8, dtype="bf16",
                           block_size=4),
    "mla": mla_spec(num_layers=2, latent_size=12, dtype="bf16", block_size=4),
    "fp8-scales16": attention_spec(num_layers=2, num_kv_heads=8, head_size=16,
                                   dtype="fp8_e4m3", block_size=4, extra_bytes_per_token=16),
    "sliding": attention_spec(num_layers=2, num_kv_heads=8, head_size=4, dtype="fp32",
                              block_size=4, sliding_window=8),
    "hybrid": KVCacheSpec((
        LayerGroup(Kind.FULL, 1, 8, 4, "bf16", 4),
        LayerGroup(Kind.SLIDING_WINDOW, 2, 4, 8, "bf16", 4, sliding_window=4))),
    "mamba": KVCacheSpec((LayerGroup(Kind.MAMBA, 2, 1, 0, "bf16", 4, state_bytes=96),)),
}


ATTENTION_LAYOUTS = ("packed-hnd", "packed-nhd", "split-nhd", "split-hnd", "separate-kv",
                     "vllm-cpu")
#: The built-in layouts that map each kind (at every TP size, except a Mamba state at TP 1
#: only: its one state is not split over ranks); every other built-in layout refuses it.
#: Per-token scale bytes (fp8) fit only the packed pages.
MAPPED_BY = {"mha32": ATTENTION_LAYOUTS, "gqa8": ATTENTION_LAYOUTS, "mqa1": ATTENTION_LAYOUTS,
             "mla": ("mla",), "fp8-scales16": ("packed-hnd", "packed-nhd"),
             "sliding": ATTENTION_LAYOUTS, "hybrid": ATTENTION_LAYOUTS, "mamba": ("mamba",)}
BUILT_IN_LAYOUTS = ATTENTION_LAYOUTS + ("mla", "mamba")


def _refused(kind: str, tp: int, layout: str) -> bool | None:
    """Whether a built-in `layout` must refuse `kind` at `tp` (`MAPPED_BY`); None for a
    layout from another plugin (its refusals are its own)."""
    if layout not in BUILT_IN_LAYOUTS:
        return None
    return layout not in MAPPED_BY[kind] or (kind == "mamba" and tp > 1)


def _layout_names() -> list[str]:
    return list(plugins.layouts())


CASES = [(kind, n, tp, layout) for kind in KINDS for n in BLOCKS_PER_CHUNK for tp in TP_SIZES
         for layout in _layout_names()]


def _load_config(kind: str, tp: int, layout: str) -> tuple[int, str]:
    """A different (TP size, layout) that maps `kind`, chosen deterministically."""
    names = _layout_names()
    spec = KINDS[kind]
    candidates = [(t, lay) for t in TP_SIZES[TP_SIZES.index(tp) + 1:] + TP_SIZES
                  for lay in names[names.index(layout) + 1:] + names
                  if (t, lay) != (tp, layout)
                  and not any(s.startswith("refused") for s in mapping_status(spec, lay, t))]
    return candidates[0] if candidates else (tp, layout)


def _store(backend, stream, spec, layout, tp, n, logical, slot, rng):
    for rank in range(tp):
        mapper = chunk_mapper(spec, layout, tp, rank, n)
        dev = make_rank_device(backend, spec, mapper.layouts, tp, rank, n + 3, rng)
        block_ids = rng.permutation(n + 3)[:n]
        place_chunk(dev, spec, mapper.layouts, tp, rank, logical, block_ids)
        upload(backend, dev)
        run_plan(backend, plan_copies(mapper, block_ids, dev.cache, slot.ptr, D2H), stream)
        backend.stream_synchronize(stream)
        free_device(backend, dev)


def _load_and_check(backend, stream, spec, layout, tp, n, logical, slot, rng, expand):
    for rank in range(tp):
        mapper = chunk_mapper(spec, layout, tp, rank, n)
        dev = make_rank_device(backend, spec, mapper.layouts, tp, rank, n + 2, rng)
        block_ids = rng.permutation(n + 2)[:n]
        plan = plan_copies(mapper, block_ids, dev.cache, slot.ptr, H2D, expand_up_to=expand)
        run_plan(backend, plan, stream)
        backend.stream_synchronize(stream)
        place_chunk(dev, spec, mapper.layouts, tp, rank, logical, block_ids)
        got = download(backend, dev)
        free_device(backend, dev)
        mismatch = device_mismatch(got, dev, block_ids)
        assert mismatch is None, f"load at tp {tp} {layout}, rank {rank}, {mismatch}"


def _roundtrip(backend, spec, n, store, load, seed, expand):
    """Store with `store` = (tp, layout), assert the canonical slot, load with `load`."""
    rng = np.random.default_rng(seed)
    logical = logical_kv(spec, n, seed=7)
    expected = canonical_chunk(logical)
    stream = backend.create_stream()
    slot = backend.alloc_pinned(expected.size)
    try:
        host_array(slot)[:] = rng.integers(0, 256, expected.size, dtype=np.uint8)
        _store(backend, stream, spec, store[1], store[0], n, logical, slot, rng)
        mismatch = canonical_mismatch(host_array(slot), spec, logical)
        assert mismatch is None, f"store at tp {store[0]} {store[1]}: {mismatch}"
        _load_and_check(backend, stream, spec, load[1], load[0], n, logical, slot, rng, expand)
    finally:
        backend.free(slot)
        backend.destroy_stream(stream)


@pytest.mark.parametrize("kind,n,tp,layout", CASES,
                         ids=[f"{k}-n{n}-tp{tp}-{lay}" for k, n, tp, lay in CASES])
def test_store_is_canonical_and_loads_into_other_tp_and_layout(backend, kind, n, tp, layout):
    """Fails when a built-in layout refuses what `MAPPED_BY` says it maps: e.g. with
    `map_group` raising LayoutError for split-hnd attention groups, the 40 split-hnd attention
    cases fail here (before the table they passed as refusals; only the mixed-groups test
    noticed)."""
    spec = KINDS[kind]
    refused = any(s.startswith("refused") for s in mapping_status(spec, layout, tp))
    assert _refused(kind, tp, layout) in (None, refused), (
        f"{layout} at tp {tp} {'refuses' if refused else 'maps'} {kind}; mapped by: "
        f"{MAPPED_BY[kind]}")
    if refused:
        with pytest.raises(LayoutError, match=r"groups\[\d+\] \(layers \d+-\d+"):
            chunk_mapper(spec, layout, tp, 0, n)
        return
    if kind == "mamba" and n > 1:  # a state chunk holds the one state at its end
        with pytest.raises(LayoutError, match=r"groups\[0\] \(layers 0-1, mamba\): a state chunk "
                           r"is the one state at the chunk's end.*got 4"):
            chunk_mapper(spec, layout, tp, 0, n)
        return
    expand = 4 if tp in (2, 8) else 1  # both ways to issue short strided runs
    _roundtrip(backend, spec, n, (tp, layout), _load_config(kind, tp, layout),
               zlib.crc32(f"{kind}-{n}-{tp}-{layout}".encode()), expand)


def test_the_refusal_table_covers_every_built_in_layout():
    """`MAPPED_BY` pins 246 of the 512 built-in cases as refusals (31 kind × layout pairs at
    every TP size, and Mamba states at TP 2, 4 and 8); a built-in layout missing from the
    registry would leave its cases unchecked."""
    built_in = [c for c in CASES if c[3] in BUILT_IN_LAYOUTS]
    assert set(BUILT_IN_LAYOUTS) <= set(_layout_names())
    assert (len(built_in), sum(_refused(k, tp, lay) for k, _, tp, lay in built_in)) == (512, 246)


def test_groups_with_their_own_layouts_round_trip(backend):
    spec = KVCacheSpec((LayerGroup(Kind.FULL, 2, 4, 4, "bf16", 4),
                        LayerGroup(Kind.MLA, 1, 1, 6, "fp16", 4, extra_bytes_per_token=4),
                        LayerGroup(Kind.SLIDING_WINDOW, 1, 2, 8, "fp8", 4, 2,
                                   sliding_window=8)))
    _roundtrip(backend, spec, 3, (2, ("split-hnd", "mla", "packed-nhd")),
               (4, ("vllm-cpu", "mla", "packed-hnd")), seed=11, expand=1)
