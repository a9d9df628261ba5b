"""The connector hands vLLM's data-parallel index to the tiers: with vLLM's own `VllmConfig`
of a data-parallel engine (DP size 2, rank 1; no engine is started, no model runs), the
scheduler side's p2p tier listens on its `port` + 1, as vLLM's p2p tier would
(`P2PSecondaryTierManager.__init__`: `port + offloading_spec.config.parallel.
data_parallel_index`, filled from `parallel_config.data_parallel_index`).
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="builds vLLM's VllmConfig (the `vllm` extra)")

import torch  # noqa: E402
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,  # noqa: E402
                         ParallelConfig, VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,  # noqa: E402
                                        KVCacheGroupSpec)

from kvhal.integrations.vllm.connector import KVHalConnector  # noqa: E402
from kvhal.integrations.harness.vllm.model import TINY, build_model  # noqa: E402

from ..tiers.p2p_helpers import KEY, fixed_port  # noqa: E402


def test_the_p2p_tier_of_dp_rank_1_listens_on_port_plus_1():
    """Seen failing with the connector not passing `data_parallel_index` to `SchedulerSide`:
    the tier listened on the base port, `'127.0.0.1:21236' == '127.0.0.1:21237'`."""
    base = fixed_port(span=2)
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(build_model(TINY)), skip_tokenizer_init=True,
                                 dtype="bfloat16", seed=0, max_model_len=2048),
        device_config=DeviceConfig("cpu"),
        parallel_config=ParallelConfig(data_parallel_size=2, data_parallel_rank=1),
        cache_config=CacheConfig(block_size=128, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVHalConnector", kv_role="kv_both",
            kv_connector_module_path="kvhal.integrations.vllm.connector",
            kv_connector_extra_config={"cpu_bytes_to_use": 4 << 20, "secondary_tiers": [
                {"type": "p2p", "auth_key": KEY, "port": base}]}))
    assert vllm_config.parallel_config.data_parallel_index == 1
    attention = FullAttentionSpec(block_size=128, num_kv_heads=TINY.num_kv_heads,
                                  head_size=TINY.head_size, dtype=torch.bfloat16)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(TINY.num_layers)]
    kv_cache_config = KVCacheConfig(num_blocks=16, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(layers, attention)])

    connector = KVHalConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    try:
        (tier,) = connector.scheduler_side.manager.tiers
        assert tier.identity == f"127.0.0.1:{base + 1}"
    finally:
        connector.scheduler_side.close()
