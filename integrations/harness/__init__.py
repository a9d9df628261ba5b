"""Trace-replay harness (`kvhal replay`): production traces through the real tiers."""
from .reference import ReferenceResult, reference_hits
from .trace import MOONCAKE_BLOCK_TOKENS, TraceFormatError, TraceRequest, iter_trace, read_trace

__all__ = ["MOONCAKE_BLOCK_TOKENS", "ReferenceResult", "TraceFormatError", "TraceRequest",
           "iter_trace", "read_trace", "reference_hits"]
