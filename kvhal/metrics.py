"""Prometheus metrics of the engine (DESIGN §8): `kvhal_*` counters with a `tier` label.

`tier` is "host" for the host tier, else a secondary tier's type name. Counters live in
prometheus-client's default registry, so an integration exposes them with its usual
`/metrics` endpoint (vLLM serves that registry). Incremented once per call with a count, never
once per chunk, to stay off the bookkeeping hot path.
"""
from __future__ import annotations

from prometheus_client import Counter

HOST = "host"

LOOKUP_CHUNKS = Counter("kvhal_lookup_chunks", "Chunks looked up, by answer",
                        ["tier", "result"])
STORED_CHUNKS = Counter("kvhal_stored_chunks", "Chunks that became readable in a tier",
                        ["tier"])
LOADED_CHUNKS = Counter("kvhal_loaded_chunks", "Chunks loaded from a tier (host: to the "
                        "device; secondary: promoted into the host tier)", ["tier"])
EVICTED_CHUNKS = Counter("kvhal_evicted_chunks", "Chunks evicted or discarded from a tier",
                         ["tier"])
FAILED_CHUNKS = Counter("kvhal_failed_chunks", "Chunks whose transfer failed, by direction",
                        ["tier", "kind"])
