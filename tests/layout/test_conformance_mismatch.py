"""The layout conformance suite's failure messages: the first differing byte by layer, block
and offset (conformance/layout_oracle.py), in the canonical slot and in a device tensor."""
from __future__ import annotations

import re

import numpy as np
import pytest

from conformance.layout_oracle import (canonical_chunk, canonical_mismatch, device_mismatch,
                                       download, free_device, logical_kv, make_rank_device,
                                       place_chunk, upload)
from conformance.test_layout_roundtrip import _roundtrip
from kvhal.backends.cpu import CpuBackend
from kvhal.layout import attention_spec

#: 2 layers × 2 heads × (2 blocks × 4 tokens) × 8-byte rows: 128 canonical bytes a layer.
SPEC = attention_spec(num_layers=2, num_kv_heads=2, head_size=2, dtype="bf16", block_size=4)


def test_canonical_mismatch_names_layer_block_head_token_and_offset():
    logical = logical_kv(SPEC, 2, seed=1)
    slot = canonical_chunk(logical)
    assert canonical_mismatch(slot, SPEC, logical) is None
    slot[128 + 1 * 64 + 5 * 8 + 3] ^= 0xFF   # layer 1, head 1, token 5 (block 1), byte 3
    slot[250] ^= 0x01

    assert canonical_mismatch(slot, SPEC, logical) == (
        f"canonical slot: first differing byte at slot offset 235: layer 1, chunk block 1, "
        f"head 1, token 5, row byte 3 (offset 107 in the layer); got {int(slot[235]):#04x}, "
        f"expected {int(slot[235]) ^ 0xFF:#04x}; 2 bytes differ")


@pytest.mark.parametrize("layout, offset, where", [
    # one 64-byte page a block: device block 4 holds no chunk block
    ("packed-hnd", 4 * 64, "device block 4 (not in the chunk: must be untouched), plane 0, "
                           "offset 0 in the page"),
    # K plane then V plane, 5 blocks of 32 bytes each: V of device block 3 (chunk block 0)
    ("separate-kv", 5 * 32 + 3 * 32 + 9, "device block 3 (chunk block 0), plane 1, offset 9 "
                                         "in the page"),
], ids=["packed-hnd", "separate-kv"])
def test_device_mismatch_names_layer_device_block_plane_and_offset(layout, offset, where):
    backend = CpuBackend()
    logical = logical_kv(SPEC, 2, seed=1)
    dev = make_rank_device(backend, SPEC, (layout,), 1, 0, 5, np.random.default_rng(2))
    block_ids = np.array([3, 1])
    place_chunk(dev, SPEC, (layout,), 1, 0, logical, block_ids)
    upload(backend, dev)
    got = download(backend, dev)
    free_device(backend, dev)
    assert device_mismatch(got, dev, block_ids) is None
    got[1][offset] ^= 0xFF

    assert device_mismatch(got, dev, block_ids) == (
        f"layer 1: first differing byte at tensor offset {offset}: {where}; got "
        f"{int(got[1][offset]):#04x}, expected {int(got[1][offset]) ^ 0xFF:#04x}; 1 bytes "
        "differ in this layer")


class FaultyCpuBackend(CpuBackend):
    """Drops the last 2D copy and the last batch descriptor of every plan it runs."""

    def copy_2d_batch_async(self, copies, stream):
        super().copy_2d_batch_async(np.asarray(copies)[:-1], stream)

    def copy_batch_async(self, dsts, srcs, sizes, stream):
        super().copy_batch_async(dsts[:-1], srcs[:-1], sizes[:-1], stream)


def test_round_trip_through_a_faulty_backend_names_the_first_differing_byte():
    """The suite's own round trip on a backend that loses copies fails with where, not a bare
    `assert False`."""
    with pytest.raises(AssertionError) as info:
        _roundtrip(FaultyCpuBackend(), SPEC, 2, (2, "packed-nhd"), (1, "split-hnd"), seed=3,
                   expand=1)

    assert re.match(r"store at tp 2 packed-nhd: canonical slot: first differing byte at slot "
                    r"offset \d+: layer \d, chunk block \d, head \d, token \d, row byte \d+ "
                    r"\(offset \d+ in the layer\); got 0x[0-9a-f]{2}, expected 0x[0-9a-f]{2}; "
                    r"\d+ bytes differ", str(info.value)), str(info.value)
