"""Assembling a manager from a validated config."""
from __future__ import annotations

from kvhal import plugins
from kvhal.config import ConfigError, EngineConfig, build_tiers
from kvhal.host.region import HostGeometry, HostLayout
from kvhal.host.slots import SlotTable

from .manager import Manager


def build_manager(config: EngineConfig, geometry: HostGeometry | HostLayout, host_view: memoryview,
                  namespace: bytes, *, emit_events: bool = True,
                  data_parallel_index: int = 0, tokens_per_chunk: int | None = None
                  ) -> Manager:
    """A manager over `geometry.capacity` slots with `config.eviction_policy` and every
    secondary tier of `config` (each given `host_view` and `namespace`).

    Args:
        config: From `kvhal.config.parse_config`.
        geometry: From `kvhal.host.host_geometry(chunk_nbytes, config.cpu_bytes_to_use)`, or
            a `HostLayout` (`kvhal.host.host_layout`) whose pool g holds the chunks of KV cache
            group g (`ChunkKey.group`), each pool with its own policy.
        host_view: The host region's memoryview (`HostRegion.view`).
        namespace: 16-byte digest from `kvhal.keys.namespace_digest`.
        emit_events: Deliver KV events to `kvhal_kv_event` hooks.
        data_parallel_index: The serving engine's data-parallel index, for the tiers that
            take it (`kvhal.config.build_tiers`; p2p listens on its `port` + it).
        tokens_per_chunk: Tokens per chunk, for the cost model (`config.cost_model`; None:
            every tier hit loads).

    Raises:
        ConfigError: a tier cannot be built (path `secondary_tiers[i]...`), or
            `cost_model.tiers` names a label no tier has (the tiers are closed again).
    """
    factory = plugins.cache_policies()[config.eviction_policy].factory
    tiers = build_tiers(config, host_view, namespace, data_parallel_index=data_parallel_index)
    common = {"tiers": tiers, "emit_events": emit_events, "tokens_per_chunk": tokens_per_chunk,
              "cost_model": config.cost_model}
    try:
        if isinstance(geometry, HostLayout):
            slots = SlotTable(geometry.capacities, [factory(c) for c in geometry.capacities],
                              pool_of=lambda key: key.group)
            return Manager(slots, slot_bytes=geometry.pools[0].slot_bytes,
                           chunk_nbytes=geometry.pools[0].chunk_nbytes, layout=geometry,
                           **common)
        return Manager(SlotTable(geometry.capacity, factory(geometry.capacity)),
                       slot_bytes=geometry.slot_bytes, chunk_nbytes=geometry.chunk_nbytes,
                       **common)
    except ValueError as exc:
        for tier in tiers:
            tier.close()
        path, _, message = str(exc).partition(": ")
        raise ConfigError(path, message) from None
