"""Per-chunk copy planning: `ChunkMapper` precomputes, `plan_copies` turns block ids into HAL calls.

A `ChunkMapper` holds, for one (spec, layouts, tp_size, tp_rank, blocks_per_chunk), every run of
every layer of every block position of a chunk as flat numpy arrays (block-position-major), so
planning one chunk is a handful of vectorised gathers: no Python loop per block or per
contiguous run; runs with more than one fragment become rows of one 2D-copy array.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .canonical import ChunkLayout, GroupMapping, chunk_layout, layouts_for, map_group
from .devices import MAX_STRIDE, DeviceLayout, tensor_element_bytes
from .geometry import KVCacheSpec, LayoutError
from .plan import CopyPlan

D2H = "d2h"
H2D = "h2d"


@dataclass(frozen=True, slots=True)
class DeviceCache:
    """Where one rank's per-layer KV tensors live.

    Attributes:
        bases: uint64 (num_layers,), address of each layer's tensor (global layer order).
        block_strides: int64 (num_layers,), bytes between consecutive device blocks.
        plane_strides: int64 (num_layers,), bytes between the K and V planes of two-plane
            layouts (`separate-kv`), 0 otherwise.
        num_blocks: Device blocks in every layer's tensor.
    """

    bases: np.ndarray
    block_strides: np.ndarray
    plane_strides: np.ndarray
    num_blocks: int


@dataclass(frozen=True, slots=True)
class _Runs:
    """Runs of a whole chunk, block-position-major; `per_block` entries per block position."""

    layer: np.ndarray
    block: np.ndarray
    local: np.ndarray
    plane: np.ndarray
    host: np.ndarray
    width: np.ndarray
    count: np.ndarray
    local_stride: np.ndarray
    canonical_stride: np.ndarray
    per_block: int

    def take(self, mask: np.ndarray, per_block: int) -> "_Runs":
        return _Runs(*(getattr(self, f)[mask] for f in _FIELDS), per_block)


_FIELDS = ("layer", "block", "local", "plane", "host", "width", "count", "local_stride",
           "canonical_stride")


@dataclass(frozen=True, slots=True)
class ChunkMapper:
    """Everything one rank needs to plan the copies of any chunk (immutable once built;
    safe to share between threads).

    Attributes:
        spec, layouts, tp_size, tp_rank, blocks_per_chunk: What it was built for (a layout
            is a registered name or a `strided_layout`).
        groups: One `GroupMapping` per spec group.
        chunk: Where each layer's canonical page sits in the host slot.
    """

    spec: KVCacheSpec
    layouts: tuple[str | DeviceLayout, ...]
    tp_size: int
    tp_rank: int
    blocks_per_chunk: int
    groups: tuple[GroupMapping, ...]
    chunk: ChunkLayout
    _tables: dict = field(compare=False, repr=False)

    @property
    def device_block_bytes(self) -> int:
        """Bytes of one device block on this rank, all layers together."""
        return sum(m.page_bytes * g.num_layers for m, g in zip(self.groups, self.spec.groups))

    def runs_per_chunk(self, direction: str) -> int:
        """Copy runs (one batch descriptor or one 2D copy each) for a full chunk."""
        return self._tables[direction].per_block * self.blocks_per_chunk

    def copies_2d_per_chunk(self, direction: str, expand_up_to: int = 1) -> int:
        """2D copies (rows of `CopyPlan.copies_2d`) in the plan of a full chunk (see
        `plan_copies`)."""
        return self._split_runs(direction, expand_up_to)[1].per_block * self.blocks_per_chunk

    def _split_runs(self, direction: str, expand_up_to: int) -> tuple["_Runs", "_Runs"]:
        """(single-fragment entries, strided entries) of a chunk, runs of at most
        `expand_up_to` fragments expanded into single fragments; computed once per argument
        pair (a racing duplicate computation stores an equal value, so threads may share)."""
        key = (direction, expand_up_to)
        if key not in self._tables:
            self._tables[key] = _split(self._tables[direction], expand_up_to)
        return self._tables[key]

    def layer_groups(self) -> np.ndarray:
        """int64 (num_layers,): group index of each global layer."""
        return np.repeat(np.arange(len(self.groups)), [g.num_layers for g in self.spec.groups])


def chunk_mapper(spec: KVCacheSpec, layout: str | Sequence[str], tp_size: int, tp_rank: int,
                 blocks_per_chunk: int) -> ChunkMapper:
    """Build (and cache) the mapper of one rank.

    Args:
        spec: The model geometry.
        layout: One layout name for every group, or a sequence with one name per group.
        tp_size, tp_rank: Tensor parallelism of the deployment and this rank.
        blocks_per_chunk: Device blocks per chunk (N).

    Raises:
        LayoutError: an unmappable combination (names the layer group and the reason).
    """
    return _chunk_mapper(spec, layouts_for(spec, layout), tp_size, tp_rank, blocks_per_chunk)


@functools.lru_cache(maxsize=256)
def _chunk_mapper(spec: KVCacheSpec, names: tuple[str, ...], tp_size: int, tp_rank: int,
                  blocks_per_chunk: int) -> ChunkMapper:
    groups = tuple(map_group(spec, gi, name, tp_size, tp_rank, blocks_per_chunk)
                   for gi, name in enumerate(names))
    chunk = chunk_layout(spec, blocks_per_chunk)
    tables = {D2H: _table(spec, groups, chunk, blocks_per_chunk, store=True),
              H2D: _table(spec, groups, chunk, blocks_per_chunk, store=False)}
    return ChunkMapper(spec, names, tp_size, tp_rank, blocks_per_chunk, groups, chunk, tables)


def _table(spec: KVCacheSpec, groups: tuple[GroupMapping, ...], chunk: ChunkLayout,
           blocks_per_chunk: int, *, store: bool) -> _Runs:
    parts = []
    for gi, (m, g) in enumerate(zip(groups, spec.groups)):
        runs = m.store_runs if store else m.runs
        fields = np.array([(r.local_offset, r.canonical_offset, r.fragment_bytes, r.count,
                            r.local_stride, r.canonical_stride) for r in runs],
                          dtype=np.int64).reshape(-1, 6)
        layers = np.arange(spec.first_layer(gi), spec.first_layer(gi) + g.num_layers)
        rows = np.tile(fields, (g.num_layers, 1))
        layer = np.repeat(layers, len(runs))
        parts.append((layer, rows, np.full(layer.size, m.block_shift, np.int64),
                      np.full(layer.size, m.plane_bytes, np.int64)))
    layer = np.concatenate([p[0] for p in parts])
    rows = np.concatenate([p[1] for p in parts])
    shift = np.concatenate([p[2] for p in parts])
    plane_bytes = np.concatenate([p[3] for p in parts])
    per_block = layer.size
    block = np.repeat(np.arange(blocks_per_chunk, dtype=np.int64), per_block)
    tile = lambda a: np.tile(a, blocks_per_chunk)  # noqa: E731
    local = tile(rows[:, 0])
    host = tile(chunk.page_offsets[layer] + rows[:, 1]) + block * tile(shift)
    return _Runs(tile(layer), block, local % tile(plane_bytes), local // tile(plane_bytes),
                 host, tile(rows[:, 2]), tile(rows[:, 3]), tile(rows[:, 4]), tile(rows[:, 5]),
                 per_block)


def _split(t: _Runs, expand_up_to: int) -> tuple[_Runs, _Runs]:
    small = t.count <= expand_up_to
    src = np.repeat(np.flatnonzero(small), t.count[small])
    counts = t.count[small]
    k = np.arange(src.size) - np.repeat(np.cumsum(counts) - counts, counts)
    width = t.width[src]
    single = _Runs(t.layer[src], t.block[src], t.local[src] + k * t.local_stride[src],
                   t.plane[src], t.host[src] + k * t.canonical_stride[src], width,
                   np.ones_like(width), width, width, int((t.block[src] == 0).sum()))
    strided = ~small
    return single, t.take(strided, int((strided & (t.block == 0)).sum()))


def device_cache(mapper: ChunkMapper, tensors: Sequence[Any]) -> DeviceCache:
    """Describe a rank's per-layer KV tensors (as vLLM's `register_kv_caches` hands them, in
    global layer order) for planning.

    Args:
        tensors: One tensor-like per layer with `data_ptr()`, `stride()` (elements),
            `element_size()` and `shape`; its physical layout must be the group's layout: the
            dims after the block dim (separate-kv: after the plane and block dims), ordered by
            stride, must be the layout's shape in that order and dense (a permuted view of a
            tensor stored in the layout's order is fine; a view whose memory order differs, or
            with gaps inside a block, is not). Blocks (and planes) may be further apart than a
            page, but never overlap. The element type may differ from the layout's as long as
            the innermost dim has the same bytes.

    Raises:
        LayoutError: wrong number of tensors, or a tensor whose shape, byte size or strides do
            not fit the layout (names the layer index).
    """
    n_layers = mapper.spec.num_layers
    if len(tensors) != n_layers:
        raise LayoutError(f"tensors: expected {n_layers} layer tensors, got {len(tensors)}",
                          field="tensors")
    groups = mapper.layer_groups()
    bases, blocks, planes, counts = [], [], [], set()
    for i, t in enumerate(tensors):
        m = mapper.groups[groups[i]]
        group = mapper.spec.groups[groups[i]]
        if m.layout.strides is not None:
            num_blocks, block_stride = _strided_blocks(i, t, m, group)
            bases.append(t.data_ptr())
            blocks.append(block_stride)
            planes.append(0)
            counts.add(num_blocks)
            continue
        two = m.layout.num_planes == 2
        shape, stride, esize = tuple(t.shape), tuple(t.stride()), t.element_size()
        outer = 2 if two else 1
        num_blocks = shape[outer - 1] if len(shape) >= outer else 0
        expect = m.layout.shape(group, m.share.num_heads, num_blocks)
        if (len(shape) < outer or num_blocks < 1 or (two and shape[0] != 2)
                or _page_dims(shape[outer:], stride[outer:], esize)
                != _page_dims(expect[outer:], _dense_strides(expect[outer:]),
                              tensor_element_bytes(group))
                or not _disjoint([(n, st * esize) for n, st in zip(shape[:outer],
                                                                    stride[:outer])],
                                 m.plane_bytes)):
            raise LayoutError(f"tensors[{i}]: shape {shape} (element {esize} B, strides "
                              f"{stride}) does not hold layout {m.layout.name!r}, expected "
                              f"{expect} stored in that order", field=f"tensors[{i}]", layer=i)
        bases.append(t.data_ptr())
        blocks.append(stride[outer - 1] * esize)
        planes.append(stride[0] * esize if two else 0)
        counts.add(num_blocks)
    if len(counts) != 1:
        raise LayoutError(f"tensors: layers have different block counts {sorted(counts)}",
                          field="tensors")
    return DeviceCache(np.array(bases, np.uint64), np.array(blocks, np.int64),
                       np.array(planes, np.int64), counts.pop())


def _strided_blocks(i: int, t: Any, m: GroupMapping, group: Any) -> tuple[int, int]:
    """(vLLM blocks, bytes between them) of layer tensor `i`, a `[B, H, N, C]` view that must
    hold `m.layout.strides` exactly: H the rank's heads, N the kernel tokens, C one contiguous
    row, the page strides equal, kernel blocks of a vLLM block `kernel_stride` apart, and no
    two elements of the view on one byte.

    Raises:
        LayoutError: names the layer index, the view's shape and byte strides, and the expected.
    """
    st = m.layout.strides
    shape, esize = tuple(t.shape), t.element_size()
    stride = tuple(s * esize for s in t.stride())
    ratio = st.kernels(group)
    expect = st.shape(group, m.share.num_heads, 1)
    ok = (len(shape) == 4 and shape[1:3] == expect[1:3] and shape[0] >= ratio
          and shape[0] % ratio == 0 and shape[3] * esize == group.row_bytes
          and (shape[3] == 1 or stride[3] == esize)
          and (shape[1] == 1 or stride[1] == st.head_stride)
          and (shape[2] == 1 or stride[2] == st.token_stride)
          and (ratio == 1 or stride[0] == st.kernel_stride)
          and 0 <= stride[0] * ratio <= MAX_STRIDE
          and _disjoint(list(zip(shape[:3], stride[:3])), group.row_bytes))
    if not ok:
        raise LayoutError(f"tensors[{i}]: shape {shape} (element {esize} B, byte strides "
                          f"{stride}) does not hold layout {m.layout.name!r}, expected "
                          f"[B, H, N, C] = (k*{ratio}, {expect[1]}, {expect[2]}, {group.row_bytes} bytes) "
                          f"with those strides",
                          field=f"tensors[{i}]", layer=i)
    return shape[0] // ratio, stride[0] * ratio


def _disjoint(dims: list[tuple[int, int]], page_bytes: int) -> bool:
    """True if the pages `page_bytes` long at every index of `dims` ((size, byte stride) of the
    block and plane dims) never overlap: sorted by stride, each stride spans all inner ones."""
    extent = page_bytes
    for n, s in sorted(dims, key=lambda d: d[1]):
        if n == 1:
            continue
        if s < extent:
            return False
        extent += (n - 1) * s
    return True


def _dense_strides(shape: tuple) -> tuple[int, ...]:
    """C-order strides (elements) of `shape`."""
    return tuple(math.prod(shape[k + 1:]) for k in range(len(shape)))


def _page_dims(shape: tuple, stride: tuple, esize: int) -> tuple[tuple[int, int], ...] | None:
    """The memory order of one page: (size, byte stride) per dim of size > 1, outermost first,
    the innermost dim counted in bytes; None if the dims are not dense (a gap, an overlap, or
    an innermost dim that is not contiguous)."""
    dims = sorted(((n, s * esize) for n, s in zip(shape, stride) if n != 1),
                  key=lambda d: -d[1])
    if not dims:
        return ()
    if dims[-1][1] != esize:
        return None
    dims[-1] = (dims[-1][0] * esize, 1)
    inner = 1
    for n, s in reversed(dims):
        if s != inner:
            return None
        inner *= n
    return tuple(dims)


def plan_copies(mapper: ChunkMapper, block_ids: np.ndarray, device: DeviceCache,
                host_addr: int, direction: str, expand_up_to: int = 1) -> CopyPlan:
    """The HAL calls that move one chunk between this rank's device blocks and a host slot.

    Args:
        mapper: From `chunk_mapper(...)` for this rank.
        block_ids: int array (n,), 1 ≤ n ≤ blocks_per_chunk: device block ids in chunk order
            (block j holds chunk tokens [j*T, (j+1)*T)); n < blocks_per_chunk plans a prefix.
        device: The rank's layer tensors (`device_cache`).
        host_addr: Address of the chunk's host slot (`mapper.chunk.chunk_bytes` bytes).
        direction: "d2h" (store: only bytes this rank is the elected writer of) or "h2d" (load:
            every byte of the rank's device pages, replicas included).
        expand_up_to: Runs of at most this many fragments go to the batch as one descriptor
            per fragment instead of one 2D copy (1 = every multi-fragment run is a 2D copy).
            A backend with a native batch call may prefer e.g. 16: fewer calls, same bytes.

    Returns:
        A `CopyPlan`: one 2D-copy row per remaining multi-fragment run per block, and uint64
        address arrays for `copy_batch_async` for single fragments. Copies never overlap.

    Raises:
        LayoutError: bad direction, expand_up_to or host_addr, block_ids not 1-D integers,
            too many, out of [0, device.num_blocks), or repeated (a chunk holds each device
            block once; a repeated id would make two loads write the same device bytes).
    """
    ids = np.asarray(block_ids)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise LayoutError(f"block_ids: must be a 1-D integer array, got {ids.dtype} "
                          f"shape {ids.shape}", field="block_ids")
    if (not isinstance(host_addr, (int, np.integer)) or isinstance(host_addr, bool)
            or not 0 <= host_addr <= 2**63 - 1 - mapper.chunk.chunk_bytes):
        raise LayoutError(f"host_addr: must be a non-negative int address, got {host_addr!r}",
                          field="host_addr")
    return plan_job_copies(mapper, ids[None], device, np.array([host_addr], np.int64),
                           direction, expand_up_to)


def plan_job_copies(mapper: ChunkMapper, block_ids: np.ndarray, device: DeviceCache,
                    host_addrs: np.ndarray, direction: str, expand_up_to: int = 1) -> CopyPlan:
    """`plan_copies` for n chunks at once, in one set of vectorised gathers.

    Args:
        block_ids: int array (n, k), 1 ≤ k ≤ blocks_per_chunk: chunk i's device block ids in
            chunk order (k < blocks_per_chunk plans the same prefix of every chunk).
        host_addrs: int array (n,): address of chunk i's host slot (bytes).
        mapper, device, direction, expand_up_to: As `plan_copies`.

    Returns:
        One `CopyPlan` equal to `kvhal.layout.plan.merge_plans` of the n `plan_copies` results,
        in chunk order (chunk 0's 2D copies, chunk 1's, ...; likewise the batch descriptors).

    Raises:
        LayoutError: as `plan_copies`; block_ids not a 2-D integer array, or host_addrs not of
            shape (n,).
    """
    if direction not in (D2H, H2D):
        raise LayoutError(f"direction: must be {D2H!r} or {H2D!r}, got {direction!r}",
                          field="direction")
    if not isinstance(expand_up_to, int) or expand_up_to < 1:
        raise LayoutError(f"expand_up_to: must be an int >= 1, got {expand_up_to!r}",
                          field="expand_up_to")
    ids = np.asarray(block_ids)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise LayoutError(f"block_ids: must be a 2-D integer array, got {ids.dtype} "
                          f"shape {ids.shape}", field="block_ids")
    if not 1 <= ids.shape[1] <= mapper.blocks_per_chunk:
        raise LayoutError(f"block_ids: {ids.shape[1]} blocks, must be "
                          f"1..{mapper.blocks_per_chunk}", field="block_ids")
    addrs = np.asarray(host_addrs)
    if addrs.size and not np.issubdtype(addrs.dtype, np.integer):
        raise LayoutError(f"host_addrs: must be integer addresses, got {addrs.dtype}",
                          field="host_addrs")
    addrs = addrs.astype(np.int64)
    if addrs.shape != ids.shape[:1]:
        raise LayoutError(f"host_addrs: shape {addrs.shape}, must be ({ids.shape[0]},)",
                          field="host_addrs")
    if ids.size and (ids.min() < 0 or ids.max() >= device.num_blocks):
        raise LayoutError(f"block_ids: ids must be in [0, {device.num_blocks}), got "
                          f"{ids.min()}..{ids.max()}", field="block_ids")
    if np.unique(ids).size != ids.size:
        raise LayoutError(f"block_ids: ids repeat in {ids.ravel().tolist()}", field="block_ids")
    if addrs.size and (addrs.min() < 0
                       or addrs.max() > 2**63 - 1 - mapper.chunk.chunk_bytes):
        raise LayoutError(f"host_addrs: must be non-negative int addresses, got "
                          f"{addrs.tolist()}", field="host_addrs")
    ids = ids.astype(np.int64)
    single, strided = mapper._split_runs(direction, expand_up_to)
    s_dev, s_host, s = _addresses(single, ids, device, addrs)
    sizes = np.tile(s.width.astype(np.uint64), len(addrs))
    d_dev, d_host, d = _addresses(strided, ids, device, addrs)
    n = len(addrs)
    copies = np.empty((len(d_dev), 6), dtype=np.uint64)
    dev_pitch, host_pitch = (1, 3) if direction == H2D else (3, 1)
    copies[:, dev_pitch - 1], copies[:, host_pitch - 1] = d_dev, d_host
    copies[:, dev_pitch] = np.tile(d.local_stride, n)
    copies[:, host_pitch] = np.tile(d.canonical_stride, n)
    copies[:, 4], copies[:, 5] = np.tile(d.width, n), np.tile(d.count, n)
    if direction == D2H:
        return CopyPlan(copies, s_host, s_dev, sizes)
    return CopyPlan(copies, s_dev, s_host, sizes)


def _addresses(t: _Runs, ids: np.ndarray, device: DeviceCache, host_addrs: np.ndarray):
    """Device and host addresses (uint64, chunk-major, flat) of the first ids.shape[1] block
    positions' entries of `t` for every chunk (row) of `ids`, and the per-chunk entries."""
    n = ids.shape[1] * t.per_block
    layer = t.layer[:n]
    dev = (device.bases[layer].astype(np.int64) + ids[:, t.block[:n]] * device.block_strides[layer]
           + t.plane[:n] * device.plane_strides[layer] + t.local[:n])
    host = t.host[:n] + host_addrs[:, None]
    view = _Runs(*(getattr(t, f)[:n] for f in _FIELDS), t.per_block)
    return dev.astype(np.uint64).ravel(), host.astype(np.uint64).ravel(), view
