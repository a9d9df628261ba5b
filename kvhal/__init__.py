"""kvhal: keep evicted LLM KV cache alive in a host-centric tier hierarchy."""
__version__ = "0.1.0"
