"""Prefill/decode disaggregation: `kvhal proxy`, speaking vLLM's p2p tier protocol.

`legs` builds the prefill and decode legs' bodies, `backends` holds the prefillers and
decoders with their health, `proxy` serves OpenAI requests through them (aiohttp, the `proxy`
extra), `cli` adds the verb. Import `proxy` explicitly: this package imports without aiohttp.
"""
from .backends import Backend, P2PAddress, parse_decoder, parse_prefiller
from .legs import BodyError, RemotePrefill, decode_body, prefill_body

__all__ = ["Backend", "BodyError", "P2PAddress", "RemotePrefill", "decode_body",
           "parse_decoder", "parse_prefiller", "prefill_body"]
