"""Integrations: the vLLM connector and the trace-replay harness."""
