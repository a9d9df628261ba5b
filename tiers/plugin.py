"""Entry point of the built-in secondary tiers (`kvhal` group)."""
from kvhal.hookspecs import hookimpl
from kvhal.plugins import TierSpec


@hookimpl
def kvhal_register_tiers():
    """Register the built-in tier types."""
    from .fs import FsTier
    from .memory import MemoryTier
    from .p2p import P2PTier
    return [TierSpec("memory", MemoryTier), TierSpec("fs", FsTier), TierSpec("p2p", P2PTier)]
