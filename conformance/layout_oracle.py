"""An independent numpy oracle of the layout formats, for the layout conformance suite.

Written from the documented shapes (kvhal/layout/devices.py docstrings, DESIGN §3) with plain
reshapes and transposes, never from kvhal's offset functions, so a wrong run fails a test.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvhal.hal import Allocation, DeviceBackend
from kvhal.layout import CopyPlan, DeviceCache, KVCacheSpec, LayerGroup, rank_share

from .hal_helpers import read, write


def logical_kv(spec: KVCacheSpec, blocks_per_chunk: int, seed: int) -> list[np.ndarray]:
    """Seeded random logical KV of one chunk: per layer uint8 (tokens, heads, row_bytes), with
    row = K ‖ V ‖ extra (MLA: latent ‖ extra; Mamba: one row of state bytes per block)."""
    rng = np.random.default_rng(seed)
    out = []
    for g in spec.groups:
        shape = (blocks_per_chunk * g.tokens_per_page, g.num_kv_heads, g.row_bytes)
        out.extend(rng.integers(0, 256, shape, dtype=np.uint8) for _ in range(g.num_layers))
    return out


def canonical_chunk(logical: list[np.ndarray]) -> np.ndarray:
    """The `kvhal-hnd-v1` chunk: each layer as [head][token][row], layers back to back."""
    return np.concatenate([kv.transpose(1, 0, 2).ravel() for kv in logical])


def device_planes(group: LayerGroup, layout: str, blk: np.ndarray) -> list[np.ndarray]:
    """One rank's device page of one block from `blk` (tokens, local heads, row): a list of
    plane byte images (two for separate-kv, else one)."""
    hb = group.head_bytes
    k, v = blk[..., :hb], blk[..., hb:2 * hb]
    pages = {
        "packed-hnd": lambda: [blk.transpose(1, 0, 2)],
        "packed-nhd": lambda: [blk],
        "split-nhd": lambda: [np.stack([k, v])],
        "split-hnd": lambda: [np.stack([k.transpose(1, 0, 2), v.transpose(1, 0, 2)])],
        "separate-kv": lambda: [k, v],
        "vllm-cpu": lambda: [np.stack([k, v]).transpose(2, 0, 1, 3)],
        "mla": lambda: [blk[:, 0, :]],
        "mamba": lambda: [blk[0, 0, :]],
    }
    return [np.ascontiguousarray(p).ravel() for p in pages[layout]()]


@dataclass
class RankDevice:
    """One rank's per-layer device tensors on a backend, and their expected bytes."""

    allocs: list[Allocation]
    expected: list[np.ndarray]
    cache: DeviceCache


def make_rank_device(backend: DeviceBackend, spec: KVCacheSpec, layouts: tuple[str, ...],
                     tp_size: int, tp_rank: int, num_blocks: int, rng: np.random.Generator
                     ) -> RankDevice:
    """Allocate and fill one rank's layer tensors with seeded random background bytes."""
    allocs, expected, bases, block_strides, plane_strides = [], [], [], [], []
    for g, name in zip(spec.groups, layouts):
        share = rank_share(g, tp_size, tp_rank)
        page = share.num_heads * g.tokens_per_page * g.row_bytes
        planes = 2 if name == "separate-kv" else 1
        for _ in range(g.num_layers):
            alloc = backend.alloc_device(num_blocks * page)
            image = rng.integers(0, 256, num_blocks * page, dtype=np.uint8)
            write(backend, alloc, image)
            allocs.append(alloc)
            expected.append(image)
            bases.append(alloc.ptr)
            block_strides.append(page // planes)
            plane_strides.append(num_blocks * page // 2 if planes == 2 else 0)
    cache = DeviceCache(np.array(bases, np.uint64), np.array(block_strides, np.int64),
                        np.array(plane_strides, np.int64), num_blocks)
    return RankDevice(allocs, expected, cache)


def place_chunk(device: RankDevice, spec: KVCacheSpec, layouts: tuple[str, ...], tp_size: int,
                tp_rank: int, logical: list[np.ndarray], block_ids: np.ndarray) -> None:
    """Put the chunk's pages (from `logical`) at `block_ids` in `device.expected`."""
    layer = 0
    for g, name in zip(spec.groups, layouts):
        share = rank_share(g, tp_size, tp_rank)
        heads = slice(share.first_head, share.first_head + share.num_heads)
        tp = g.tokens_per_page
        for _ in range(g.num_layers):
            image, nb = device.expected[layer], device.cache.num_blocks
            plane_bytes = image.size // nb // (2 if name == "separate-kv" else 1)
            for j, b in enumerate(block_ids):
                blk = logical[layer][j * tp:(j + 1) * tp, heads, :]
                for p, plane in enumerate(device_planes(g, name, blk)):
                    start = p * nb * plane_bytes + b * plane_bytes
                    image[start:start + plane.size] = plane
            layer += 1


def upload(backend: DeviceBackend, device: RankDevice) -> None:
    """Write `device.expected` into the device allocations."""
    for alloc, image in zip(device.allocs, device.expected):
        write(backend, alloc, image)


def download(backend: DeviceBackend, device: RankDevice) -> list[np.ndarray]:
    """Read every layer allocation back."""
    return [read(backend, alloc) for alloc in device.allocs]


def run_plan(backend: DeviceBackend, plan: CopyPlan, stream) -> None:
    """Submit a plan's 2D copies (one `copy_2d_batch_async`) and its batch to `stream`."""
    backend.copy_2d_batch_async(plan.copies_2d, stream)
    backend.copy_batch_async(plan.dsts, plan.srcs, plan.sizes, stream)


def free_device(backend: DeviceBackend, device: RankDevice) -> None:
    """Free every layer allocation."""
    for alloc in device.allocs:
        backend.free(alloc)



def _first_difference(got: np.ndarray, expected: np.ndarray) -> tuple[int, int] | None:
    """(offset of the first differing byte, number of differing bytes), or None if equal."""
    differ = np.flatnonzero(got != expected)
    return (int(differ[0]), len(differ)) if len(differ) else None


def _groups_of_layers(spec: KVCacheSpec) -> list[LayerGroup]:
    """The group of each layer, in layer order."""
    return [g for g in spec.groups for _ in range(g.num_layers)]


def canonical_mismatch(got: np.ndarray, spec: KVCacheSpec, logical: list[np.ndarray]
                       ) -> str | None:
    """None if the host slot `got` (uint8) is the canonical chunk of `logical`, else one line
    naming the first differing byte: its slot offset, layer, block of the chunk, head, token
    and byte of the token's row (canonical layer = [head][token][row], layers back to back)."""
    expected = canonical_chunk(logical)
    first = _first_difference(got, expected)
    if first is None:
        return None
    offset, count = first
    in_layer = offset
    for layer, (group, kv) in enumerate(zip(_groups_of_layers(spec), logical)):
        if in_layer < kv.size:
            break
        in_layer -= kv.size
    tokens, _, row = kv.shape
    head, rest = divmod(in_layer, tokens * row)
    token, byte = divmod(rest, row)
    return (f"canonical slot: first differing byte at slot offset {offset}: layer {layer}, "
            f"chunk block {token // group.tokens_per_page}, head {head}, token {token}, row "
            f"byte {byte} (offset {in_layer} in the layer); got {int(got[offset]):#04x}, "
            f"expected {int(expected[offset]):#04x}; {count} bytes differ")


def device_mismatch(got: list[np.ndarray], device: RankDevice, block_ids: np.ndarray
                    ) -> str | None:
    """None if every layer tensor `got` (uint8, as `download` returns) holds
    `device.expected`, else one line naming the first differing byte: its layer, device
    block (and which block of the chunk it holds, if any), plane (separate-kv: 0 = K,
    1 = V) and offset in the block's page."""
    chunk_block = {int(b): j for j, b in enumerate(block_ids)}
    for layer, (g, e) in enumerate(zip(got, device.expected)):
        first = _first_difference(g, e)
        if first is None:
            continue
        offset, count = first
        nb = device.cache.num_blocks
        page = int(device.cache.block_strides[layer])
        plane, rest = divmod(offset, nb * page)
        block, in_page = divmod(rest, page)
        held = (f"chunk block {chunk_block[block]}" if block in chunk_block
                else "not in the chunk: must be untouched")
        return (f"layer {layer}: first differing byte at tensor offset {offset}: device block "
                f"{block} ({held}), plane {plane}, offset {in_page} in the page; got "
                f"{int(g[offset]):#04x}, expected {int(e[offset]):#04x}; {count} bytes differ "
                "in this layer")
    return None
