"""vLLM plugin (`vllm.general_plugins` entry point): registers "KVHalConnector" by name."""
from __future__ import annotations


def register() -> None:
    """Register `KVHalConnector` with vLLM's connector factory (idempotent; vLLM calls every
    general plugin in each of its processes)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if "KVHalConnector" not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector("KVHalConnector",
                                              "kvhal.integrations.vllm.connector",
                                              "KVHalConnector")
