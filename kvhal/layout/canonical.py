"""Canonical pages and the copy runs between a rank's device page and them (DESIGN §3).

Format `kvhal-hnd-v1`. The canonical page of one layer and one chunk (N = blocks_per_chunk
blocks of T tokens) is `[global_head][chunk_token][row]`, row = `K ‖ V ‖ extra` (MLA: `latent ‖
extra`, one head; Mamba: the one opaque state after the chunk's last token), where chunk_token = j*T + t
for token t of the chunk's j-th block. It is the byte image of a packed-HND page at TP = 1 with
N*T tokens, so it depends on tokens per chunk, never on TP size, block size or device layout.
Per-token extra bytes sit at the end of each (head, token) row, right after V.

The host slot of a chunk holds the canonical pages of all layers back to back, in global layer
order (`[group][layer][canonical page]`, no padding): layer i's page starts at
`ChunkLayout.page_offsets[i]`.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import numpy as np

from .devices import DeviceLayout, get_layout
from .geometry import Kind, KVCacheSpec, LayerGroup, LayoutError
from .plan import CopyRun

FORMAT_ID = "kvhal-hnd-v1"

#: Largest accepted blocks_per_chunk and tp_size: far above real deployments (chunks of a few
#: dozen blocks, TP ≤ 64), low enough that chunk offsets fit int64 (with the geometry bounds of
#: `kvhal.layout.geometry`) and per-rank loops stay short.
MAX_BLOCKS_PER_CHUNK = 1 << 16
MAX_TP_SIZE = 1 << 10


@dataclass(frozen=True, slots=True)
class RankShare:
    """Which KV heads one TP rank holds for one group.

    Attributes:
        first_head: Global index of the rank's first KV head.
        num_heads: KV heads on the rank (consecutive from `first_head`).
        replicas: Ranks holding the same heads (> 1 for GQA with tp > heads, and for MLA).
        writer: True if this rank's bytes go to the host on store (lowest rank of its replicas).
    """

    first_head: int
    num_heads: int
    replicas: int
    writer: bool


@dataclass(frozen=True, slots=True)
class GroupMapping:
    """One rank's mapping of one layer group (identical for every layer of the group).

    Attributes:
        group_index: Index into `spec.groups`.
        layout: The device layout.
        share: The rank's heads and writer flag.
        page_bytes: Bytes of the rank's device page (one layer, one block).
        plane_bytes: Bytes of one plane of that page (= page_bytes for one-plane layouts).
        canonical_page_bytes: Bytes of the canonical page (one layer, one chunk, all heads).
        block_shift: Canonical bytes between the runs of consecutive blocks of a chunk: block j
            of the chunk uses `runs` with `canonical_offset + j * block_shift`.
        runs: Coalesced runs of chunk block 0 covering the whole device page (loads: H2D).
        store_runs: `runs` if `share.writer` else () (stores: D2H).
    """

    group_index: int
    layout: DeviceLayout
    share: RankShare
    page_bytes: int
    plane_bytes: int
    canonical_page_bytes: int
    block_shift: int
    runs: tuple[CopyRun, ...]
    store_runs: tuple[CopyRun, ...]


@dataclass(frozen=True, slots=True)
class ChunkLayout:
    """Where each layer's canonical page sits in a chunk's host slot.

    Attributes:
        page_offsets: int64 array (num_layers,), byte offset of global layer i's canonical page.
        page_bytes: int64 array (num_layers,), bytes of each layer's canonical page.
        chunk_bytes: Total canonical bytes of one chunk (all layers).
    """

    page_offsets: np.ndarray
    page_bytes: np.ndarray
    chunk_bytes: int


def canonical_page_bytes(group: LayerGroup, blocks_per_chunk: int) -> int:
    """Exact bytes of one layer's canonical page for one chunk, extra bytes included. A Mamba
    page is the one state at the chunk's end, whatever `blocks_per_chunk`."""
    if group.kind is Kind.MAMBA:
        return group.state_bytes
    return group.num_kv_heads * blocks_per_chunk * group.tokens_per_page * group.row_bytes


def chunk_layout(spec: KVCacheSpec, blocks_per_chunk: int) -> ChunkLayout:
    """The canonical chunk: every layer's page back to back in global layer order.

    Raises:
        LayoutError: blocks_per_chunk is not a positive int.
    """
    _check_positive(blocks_per_chunk, "blocks_per_chunk", MAX_BLOCKS_PER_CHUNK)
    sizes = np.concatenate([np.full(g.num_layers, canonical_page_bytes(g, blocks_per_chunk),
                                    dtype=np.int64) for g in spec.groups])
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    return ChunkLayout(offsets, sizes, int(sizes.sum()))


def _check_positive(value: object, name: str, limit: int) -> None:
    if (not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_))
            or not 0 < value <= limit):
        raise LayoutError(f"{name}: must be an int in [1, {limit}], got {value!r}", field=name)


def _where(spec: KVCacheSpec, gi: int) -> tuple[str, int]:
    group = spec.groups[gi]
    first = spec.first_layer(gi)
    return (f"groups[{gi}] (layers {first}-{first + group.num_layers - 1}, "
            f"{group.kind.value})"), first


def _refuse(spec: KVCacheSpec, gi: int, reason: str) -> LayoutError:
    where, first = _where(spec, gi)
    return LayoutError(f"{where}: {reason}", layer=first, reason=reason)


def rank_share(group: LayerGroup, tp_size: int, tp_rank: int) -> RankShare:
    """The heads TP rank `tp_rank` of `tp_size` holds, vLLM's split: heads divide evenly over
    ranks; with tp_size > heads each head is replicated on tp_size // heads consecutive ranks
    (rank r holds head r // replicas); MLA is replicated on every rank; the lowest rank of a
    replica set is the writer.

    Raises:
        LayoutError: bad tp_size/tp_rank, heads and tp_size that do not divide, or a Mamba group
            with tp_size > 1 (its opaque state's TP sharding is unknown). `reason` is set.
    """
    _check_positive(tp_size, "tp_size", MAX_TP_SIZE)
    if not isinstance(tp_rank, (int, np.integer)) or not 0 <= tp_rank < tp_size:
        raise LayoutError(f"tp_rank: must be in [0, {tp_size}), got {tp_rank!r}",
                          field="tp_rank")
    if group.kind is Kind.MAMBA:
        if tp_size > 1:
            raise LayoutError("mamba state is opaque and its TP sharding is unknown; "
                              "only tp_size 1 maps to a TP-independent page")
        return RankShare(0, 1, 1, True)
    if group.kind is Kind.MLA:
        return RankShare(0, 1, tp_size, tp_rank == 0)
    heads = group.num_kv_heads
    if tp_size <= heads:
        if heads % tp_size:
            raise LayoutError(f"{heads} KV heads do not split evenly over tp_size {tp_size}")
        per_rank = heads // tp_size
        return RankShare(tp_rank * per_rank, per_rank, 1, True)
    if tp_size % heads:
        raise LayoutError(f"tp_size {tp_size} is not a multiple of the {heads} KV heads, so "
                          "heads cannot be replicated evenly")
    replicas = tp_size // heads
    return RankShare(tp_rank // replicas, 1, replicas, tp_rank % replicas == 0)


def check_layout(spec: KVCacheSpec, gi: int, layout: DeviceLayout) -> None:
    """Refuse a layout that cannot hold group `gi` (wrong kind, no place for extra bytes).

    Raises:
        LayoutError: naming the group's layers and the reason.
    """
    group = spec.groups[gi]
    if group.kind not in layout.kinds:
        from kvhal import plugins

        fits = [n for n, lay in plugins.layouts().items() if group.kind in lay.kinds]
        raise _refuse(spec, gi, f"layout {layout.name!r} cannot store {group.kind.value} pages; "
                                f"layouts for {group.kind.value}: {', '.join(fits)}")
    if group.extra_bytes_per_token and not layout.supports_extra_bytes:
        raise _refuse(spec, gi, f"layout {layout.name!r} has no place for "
                                f"{group.extra_bytes_per_token} extra bytes per token")
    if layout.strides is not None and group.tokens_per_page % layout.strides.kernel_tokens:
        raise _refuse(spec, gi, f"layout {layout.name!r}: kernel blocks of "
                                f"{layout.strides.kernel_tokens} tokens do not divide the "
                                f"block of {group.tokens_per_page}")


def resolve_layout(layout: str | DeviceLayout) -> DeviceLayout:
    """A registered layout by name, or `layout` itself when it is a `DeviceLayout` (a
    `kvhal.layout.strided_layout`).

    Raises:
        LayoutError: an unknown name (lists the registered ones).
    """
    return layout if isinstance(layout, DeviceLayout) else get_layout(layout)


@functools.lru_cache(maxsize=4096)
def map_group(spec: KVCacheSpec, gi: int, layout_name: str | DeviceLayout, tp_size: int,
              tp_rank: int, blocks_per_chunk: int) -> GroupMapping:
    """The runs between rank `tp_rank`'s device page of group `gi` and the canonical page.

    Pure and cached per argument tuple. `layout_name` is a registered layout's name or a
    `DeviceLayout` (`strided_layout`).

    Raises:
        LayoutError: an unknown layout, or an unmappable combination (a Mamba group with
            blocks_per_chunk > 1 among them, a strided page whose rows overlap); the message
            names the group's layers and the reason (`.reason`, `.layer`).
    """
    _check_positive(blocks_per_chunk, "blocks_per_chunk", MAX_BLOCKS_PER_CHUNK)
    if not isinstance(gi, int) or isinstance(gi, bool) or not 0 <= gi < len(spec.groups):
        raise LayoutError(f"group_index: must be in [0, {len(spec.groups)}), got {gi!r}",
                          field="group_index")
    layout = resolve_layout(layout_name)
    check_layout(spec, gi, layout)
    group = spec.groups[gi]
    if group.kind is Kind.MAMBA and blocks_per_chunk != 1:
        raise _refuse(spec, gi, f"a state chunk is the one state at the chunk's end, not one "
                                f"per block: map it with blocks_per_chunk 1, got "
                                f"{blocks_per_chunk}")
    try:
        share = rank_share(group, tp_size, tp_rank)
    except LayoutError as exc:
        if exc.field:
            raise
        raise _refuse(spec, gi, exc.reason) from None
    tokens, row = group.tokens_per_page, group.row_bytes
    local = layout.offsets(group, share.num_heads)
    if layout.strides is not None:
        _check_rows_apart(spec, gi, layout, local[:, :, 0].ravel(), row)
    sizes = np.asarray(group.component_bytes, dtype=np.int64)
    h, t, c = np.indices(local.shape, dtype=np.int64)
    comp = (np.cumsum(sizes) - sizes)[c]
    canonical = (share.first_head + h) * blocks_per_chunk * tokens * row + t * row + comp
    page = layout.page_bytes(group, share.num_heads)
    plane = layout.plane_bytes(group, share.num_heads)
    runs = coalesce(local.ravel(), canonical.ravel(), sizes[c].ravel(),
                    (h.ravel(), t.ravel(), c.ravel()), plane)
    return GroupMapping(gi, layout, share, page, plane,
                        canonical_page_bytes(group, blocks_per_chunk), tokens * row, runs,
                        runs if share.writer else ())


def _check_rows_apart(spec: KVCacheSpec, gi: int, layout: DeviceLayout, starts: np.ndarray,
                      row_bytes: int) -> None:
    """Refuse a strided page whose rows (`row_bytes` from each of `starts`) overlap."""
    ordered = np.sort(starts)
    if ordered.size > 1 and (np.diff(ordered) < row_bytes).any():
        raise _refuse(spec, gi, f"layout {layout.name!r}: rows of {row_bytes} bytes overlap")


def coalesce(local: np.ndarray, canonical: np.ndarray, sizes: np.ndarray,
             keys: tuple[np.ndarray, ...], plane_bytes: int) -> tuple[CopyRun, ...]:
    """Fewest strided runs moving pieces `local[i] → canonical[i]` of `sizes[i]` bytes.

    Pieces adjacent in both spaces (and in one plane) merge into fragments; fragments (and, as
    a second candidate, the unmerged pieces) then group into arithmetic runs greedily along each
    order of the index `keys` (e.g. head, token, component), keeping the candidate with fewest
    runs; a run whose fragments are back to back in both spaces becomes one fragment. Runs never
    cross a plane; both strides of a multi-fragment run are ≥ its fragment bytes (HAL pitch ≥
    width). A single-fragment run has count 1 and both strides equal to fragment_bytes.

    Args:
        local, canonical, sizes: int64 arrays (n,), byte offsets and sizes; size-0 pieces drop.
        keys: int64 arrays (n,) indexing each piece in the logical page.
        plane_bytes: Bytes per plane of the local page.
    """
    keep = sizes > 0
    local, canonical, sizes = local[keep], canonical[keep], sizes[keep]
    keys = tuple(k[keep] for k in keys)
    order = np.argsort(local, kind="stable")
    local, canonical, sizes = local[order], canonical[order], sizes[order]
    keys = tuple(k[order] for k in keys)
    plane = local // plane_bytes
    start = np.ones(local.size, dtype=bool)
    start[1:] = ((local[1:] != local[:-1] + sizes[:-1])
                 | (canonical[1:] != canonical[:-1] + sizes[:-1]) | (plane[1:] != plane[:-1]))
    first = np.flatnonzero(start)
    merged = ((local[first], canonical[first], np.add.reduceat(sizes, first), plane[first]),
              [k[first] for k in keys])
    best: list[CopyRun] | None = None
    for frag, frag_keys in (merged, ((local, canonical, sizes, plane), keys)):
        for perm in itertools.permutations(range(len(frag_keys))):
            order = np.lexsort([frag_keys[i] for i in reversed(perm)])
            runs = _greedy_runs(*(a[order].tolist() for a in frag))
            if best is None or len(runs) < len(best):
                best = runs
    return tuple(best or ())


def _greedy_runs(loc: list, can: list, size: list, plane: list) -> list[CopyRun]:
    runs, i, n = [], 0, len(loc)
    while i < n:
        j, s = i + 1, size[i]
        dl = loc[j] - loc[i] if j < n else 0
        dc = can[j] - can[i] if j < n else 0
        if j < n and size[j] == s and plane[j] == plane[i] and dl >= s and dc >= s:
            j += 1
            while (j < n and size[j] == s and plane[j] == plane[i]
                   and loc[j] - loc[j - 1] == dl and can[j] - can[j - 1] == dc):
                j += 1
            if dl == dc == s:  # back to back in both: one contiguous fragment
                runs.append(CopyRun(loc[i], can[i], s * (j - i), 1, s * (j - i), s * (j - i)))
            else:
                runs.append(CopyRun(loc[i], can[i], s, j - i, dl, dc))
        else:
            runs.append(CopyRun(loc[i], can[i], s, 1, s, s))
        i = j
    return runs


def layouts_for(spec: KVCacheSpec, layout: str | tuple[str, ...]) -> tuple[str, ...]:
    """One layout name per group: a single name applies to every group.

    Raises:
        LayoutError: a sequence whose length differs from the number of groups, or a name that
            is not a string.
    """
    if isinstance(layout, (str, DeviceLayout)):
        return (layout,) * len(spec.groups)
    layout = tuple(layout)
    if not all(isinstance(name, (str, DeviceLayout)) for name in layout):
        raise LayoutError(f"layout: names must be strings or DeviceLayouts, got {layout!r}",
                          field="layout")
    if len(layout) != len(spec.groups):
        raise LayoutError(f"layout: {len(layout)} names for {len(spec.groups)} groups",
                          field="layout")
    return layout


def mapping_status(spec: KVCacheSpec, layout: str | tuple[str, ...], tp_size: int
                   ) -> tuple[str, ...]:
    """Per group: "canonical" (each canonical byte on exactly one rank), "replicated" (some
    ranks hold the same bytes; a writer is elected), or "refused: <reason>"."""
    out = []
    for gi, name in enumerate(layouts_for(spec, layout)):
        try:
            m = map_group(spec, gi, name, tp_size, 0, 1)
        except LayoutError as exc:
            out.append(f"refused: {exc.reason}")
            continue
        out.append("replicated" if m.share.replicas > 1 else "canonical")
    return tuple(out)


def run_fragments(runs, side: str, shift: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """int64 arrays (start offsets, sizes) of every fragment of `runs` on `side` ("local" or
    "canonical"), canonical offsets moved by `shift` bytes, in run order."""
    if not runs:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    off = np.array([getattr(r, f"{side}_offset") for r in runs], np.int64) + shift
    stride = np.array([getattr(r, f"{side}_stride") for r in runs], np.int64)
    count = np.array([r.count for r in runs], np.int64)
    size = np.array([r.fragment_bytes for r in runs], np.int64)
    idx = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
    return np.repeat(off, count) + idx * np.repeat(stride, count), np.repeat(size, count)


def check_tiles(starts: np.ndarray, sizes: np.ndarray, total: int, what: str) -> None:
    """Prove the intervals [start, start + size) tile [0, total) exactly: no gap, no overlap.

    Raises:
        LayoutError: naming `what` and the first offset that is uncovered or covered twice.
    """
    order = np.argsort(starts, kind="stable")
    starts, sizes = starts[order], sizes[order]
    ends = np.concatenate([[0], starts + sizes])
    bad = np.flatnonzero(np.concatenate([starts, [total]]) != ends)
    if bad.size:
        i = int(bad[0])
        prev_end = int(ends[i])
        if i == starts.size:
            problem, at = ("gap", prev_end) if prev_end < total else ("overrun", total)
        else:
            problem, at = (("gap", prev_end) if starts[i] > prev_end
                           else ("overlap", int(starts[i])))
        raise LayoutError(f"{what}: {problem} at byte {at} of {total}", reason=problem)


def check_spread(starts: np.ndarray, sizes: np.ndarray, nbytes: int, extent: int,
                 what: str) -> None:
    """Prove the intervals [start, start + size) never overlap, lie in [0, extent) and cover
    `nbytes` bytes: a page spread over its extent (`PageStrides`) is moved exactly once.

    Raises:
        LayoutError: naming `what` and the first overlap, or the bytes covered.
    """
    order = np.argsort(starts, kind="stable")
    starts, sizes = starts[order], sizes[order]
    ends = starts + sizes
    bad = np.flatnonzero(starts[1:] < ends[:-1])
    if bad.size:
        at = int(starts[bad[0] + 1])
        raise LayoutError(f"{what}: overlap at byte {at}", reason="overlap")
    if starts.size and (starts[0] < 0 or ends[-1] > extent) or int(sizes.sum()) != nbytes:
        raise LayoutError(f"{what}: covers {int(sizes.sum())} bytes in [0, {extent}), the page "
                          f"has {nbytes}", reason="coverage")


def verify_tiling(spec: KVCacheSpec, layout: str | tuple[str, ...], tp_size: int,
                  blocks_per_chunk: int) -> None:
    """Prove the mapping of every group is exact for every rank.

    Checks: each rank's runs cover its device page exactly once, no run crosses a plane, and
    the store runs of all ranks, over all blocks of a chunk, tile the canonical page exactly
    (each canonical byte has one writer); load runs read only inside the canonical page.

    Raises:
        LayoutError: the combination is refused, or a proof fails (names group, rank, offset).
    """
    _check_positive(tp_size, "tp_size", MAX_TP_SIZE)
    for gi, name in enumerate(layouts_for(spec, layout)):
        where, _ = _where(spec, gi)
        canon_starts, canon_sizes = [], []
        for rank in range(tp_size):
            m = map_group(spec, gi, name, tp_size, rank, blocks_per_chunk)
            lo, sz = run_fragments(m.runs, "local")
            if m.layout.strides is None:
                check_tiles(lo, sz, m.page_bytes, f"{where} rank {rank} device page")
            else:
                check_spread(lo, sz, m.page_bytes, m.plane_bytes,
                             f"{where} rank {rank} device page")
            if np.any(lo // m.plane_bytes != (lo + sz - 1) // m.plane_bytes):
                raise LayoutError(f"{where} rank {rank}: a fragment crosses a plane")
            for j in range(blocks_per_chunk):
                st, sz = run_fragments(m.runs, "canonical", j * m.block_shift)
                if st.size and (st.min() < 0 or (st + sz).max() > m.canonical_page_bytes):
                    raise LayoutError(f"{where} rank {rank}: a load run reads outside the "
                                      "canonical page")
                if m.share.writer:
                    canon_starts.append(st)
                    canon_sizes.append(sz)
        check_tiles(np.concatenate(canon_starts), np.concatenate(canon_sizes),
                    canonical_page_bytes(spec.groups[gi], blocks_per_chunk),
                    f"{where} canonical page writers")
