"""Assembling a manager from a validated config."""
from __future__ import annotations

from kvhal import plugins
from kvhal.config import EngineConfig, build_tiers
from kvhal.host.region import HostGeometry
from kvhal.host.slots import SlotTable

from .manager import Manager


def build_manager(config: EngineConfig, geometry: HostGeometry, host_view: memoryview,
                  namespace: bytes, *, emit_events: bool = True) -> Manager:
    """A manager over `geometry.capacity` slots with `config.eviction_policy` and every
    secondary tier of `config` (each given `host_view` and `namespace`).

    Args:
        config: From `kvhal.config.parse_config`.
        geometry: From `kvhal.host.host_geometry(chunk_nbytes, config.cpu_bytes_to_use)`.
        host_view: The host region's memoryview (`HostRegion.view`).
        namespace: 16-byte digest from `kvhal.keys.namespace_digest`.
        emit_events: Deliver KV events to `kvhal_kv_event` hooks.

    Raises:
        ConfigError: a tier cannot be built (path `secondary_tiers[i]...`).
    """
    policy = plugins.cache_policies()[config.eviction_policy].factory(geometry.capacity)
    tiers = build_tiers(config, host_view, namespace)
    return Manager(SlotTable(geometry.capacity, policy), slot_bytes=geometry.slot_bytes,
                   chunk_nbytes=geometry.chunk_nbytes, tiers=tiers, emit_events=emit_events)
