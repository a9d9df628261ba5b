"""kvhal's vLLM integration: `KVHalConnector` (imported lazily: it needs vLLM) and the tiny
models, workload and demo built on it."""


def __getattr__(name: str):
    if name == "KVHalConnector":
        from .connector import KVHalConnector

        return KVHalConnector
    raise AttributeError(name)
