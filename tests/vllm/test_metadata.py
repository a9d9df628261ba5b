"""Worker → scheduler metadata across TP ranks, and the layout a vLLM state tensor maps to
(attention and MLA views: `test_views.py`)."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the connector's metadata subclasses vLLM's (vllm extra)")

import torch  # noqa: E402

from kvhal.integrations.vllm.geometry import (UnsupportedModelError,  # noqa: E402
                                              state_layout_name)
from kvhal.integrations.vllm.metadata import KVHalWorkerMetadata  # noqa: E402


def test_aggregate_sums_ranks_and_keeps_the_smallest_num_ok():
    rank0 = KVHalWorkerMetadata({7: 1, 8: 1}, {7: 4, 8: 2})
    rank1 = KVHalWorkerMetadata({7: 1}, {7: 3})
    merged = rank0.aggregate(rank1)
    assert merged.ranks_done == {7: 2, 8: 1}
    assert merged.num_ok == {7: 3, 8: 2}


def test_vllm_state_page_view_maps_to_the_state_layout():
    # vLLM 0.32 hands a state layer its raw page view (num_blocks, 1, 1, state bytes) int8,
    # blocks a padded page apart (measured on vLLM-CPU, tiny Qwen3-Next: strides (65536, ...)).
    pages = torch.empty(8, 65536, dtype=torch.int8)[:, :35840].reshape(8, 1, 1, 35840)
    assert state_layout_name(pages) == "mamba"
    with pytest.raises(UnsupportedModelError, match=r"state tensor of shape \(8, 3, 512\)"):
        state_layout_name(torch.empty(8, 3, 512, dtype=torch.bfloat16))


def test_kvhal_leaves_vllms_load_failure_policy_at_its_default():
    from kvhal.integrations.harness.vllm.engine import kv_transfer_config

    config = kv_transfer_config({"cpu_bytes_to_use": 1 << 20})
    assert "kv_load_failure_policy" not in config
    assert config["kv_role"] == "kv_both"
