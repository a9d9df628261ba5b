"""Integrations: the vLLM connector, the trace-replay harness and the P/D proxy."""
