"""Entry point of the built-in host-tier cache policies (`kvhal` group)."""
from kvhal.hookspecs import hookimpl
from kvhal.plugins import PolicySpec


@hookimpl
def kvhal_register_cache_policies():
    """Register `lru` and `arc`."""
    from .policy import ARCPolicy, LRUPolicy
    return [PolicySpec("lru", LRUPolicy), PolicySpec("arc", ARCPolicy)]
