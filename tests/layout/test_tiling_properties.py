"""Property tests over random geometries: every mapping tiles exactly or is refused."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvhal.layout import (BUILTIN_LAYOUTS, ELEMENT_BYTES, Kind, KVCacheSpec, LayerGroup,
                          LayoutError, check_tiles, get_layout, map_group, run_fragments,
                          verify_tiling)

LAYOUTS = [lay.name for lay in BUILTIN_LAYOUTS]
REFUSALS = ("cannot store", "has no place for", "do not split evenly", "is not a multiple of",
            "mamba state is opaque", "a state chunk is the one state")


@st.composite
def geometries(draw):
    kind = draw(st.sampled_from(list(Kind)))
    heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8])) if kind in (Kind.FULL,
                                                                 Kind.SLIDING_WINDOW) else 1
    mamba = kind is Kind.MAMBA
    group = LayerGroup(
        kind, draw(st.integers(1, 2)), heads, 0 if mamba else draw(st.integers(1, 6)),
        draw(st.sampled_from(sorted(ELEMENT_BYTES))), draw(st.integers(1, 5)),
        0 if mamba else draw(st.sampled_from([0, 0, 1, 4, 16])),
        draw(st.integers(1, 64)) if kind is Kind.SLIDING_WINDOW else None,
        draw(st.integers(1, 40)) if mamba else 0)
    fits = [lay.name for lay in BUILTIN_LAYOUTS if kind in lay.kinds]
    return (KVCacheSpec((group,)), draw(st.sampled_from(fits * 3 + LAYOUTS)),
            draw(st.sampled_from([1, 2, 3, 4, 8, 12])), draw(st.integers(1, 3)))


SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(geometries())
def test_mapping_tiles_exactly_or_is_refused(geometry):
    spec, layout, tp, n = geometry
    try:
        verify_tiling(spec, layout, tp, n)
    except LayoutError as exc:
        assert exc.reason.startswith(REFUSALS) or any(r in exc.reason for r in REFUSALS), exc
        assert str(exc).startswith("groups[0] (layers 0-")
        return
    for rank in range(tp):
        for run in map_group(spec, 0, layout, tp, rank, n).runs:
            assert run.fragment_bytes > 0 and run.count >= 1
            if run.count > 1:
                assert run.local_stride >= run.fragment_bytes
                assert run.canonical_stride >= run.fragment_bytes


@SETTINGS
@given(geometries(), st.integers(0, 2**32 - 1))
def test_coalesced_runs_move_each_byte_where_the_layout_puts_it(geometry, seed):
    spec, layout, tp, n = geometry
    group = spec.groups[0]
    try:
        m = map_group(spec, 0, layout, tp, tp - 1, n)
    except LayoutError:
        return
    page = np.random.default_rng(seed).integers(0, 256, m.page_bytes, dtype=np.uint8)
    via_runs = np.zeros(m.canonical_page_bytes, np.uint8)
    for start_l, start_c, size in zip(*run_fragments(m.runs, "local")[:1],
                                      *run_fragments(m.runs, "canonical")):
        via_runs[start_c:start_c + size] = page[start_l:start_l + size]
    # the same move piece by piece from the layout's own offsets (no coalescing)
    local = get_layout(layout).offsets(group, m.share.num_heads)
    sizes = np.asarray(group.component_bytes)
    via_pieces = np.zeros_like(via_runs)
    row, tokens = group.row_bytes, group.tokens_per_page
    for (h, t, c), off in np.ndenumerate(local):
        canon = ((m.share.first_head + h) * n * tokens + t) * row + sizes[:c].sum()
        via_pieces[canon:canon + sizes[c]] = page[off:off + sizes[c]]
    assert np.array_equal(via_runs, via_pieces)


@SETTINGS
@given(geometries(), st.data())
def test_a_broken_run_set_fails_the_tiling_proof(geometry, data):
    spec, layout, tp, n = geometry
    try:
        m = map_group(spec, 0, layout, tp, 0, n)
    except LayoutError:
        return
    runs = list(m.runs)
    i = data.draw(st.integers(0, len(runs) - 1))
    if data.draw(st.booleans()):
        del runs[i]
    else:
        runs[i] = dataclasses.replace(runs[i], local_offset=runs[i].local_offset + 1)
    with pytest.raises(LayoutError, match=r"(gap|overlap|overrun) at byte \d+"):
        check_tiles(*run_fragments(tuple(runs), "local"), m.page_bytes, "page")
