"""kvhal's vLLM integration: the `KVHalConnector` and the tiny models the demo and tests use."""
