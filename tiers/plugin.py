"""Entry point of the built-in secondary tiers (`kvhal` group)."""
from kvhal.hookspecs import hookimpl
from kvhal.plugins import TierSpec

from .base import TierError


def obj_tier(config, host, namespace):
    """Build an `ObjTier`; its client library (obstore, the `s3` extra) is imported only here.

    Raises:
        TierError: obstore is not installed (names the extra to install), or the tier's own.
    """
    try:
        from .obj import ObjTier
    except ImportError as exc:
        raise TierError(f"type: the obj tier needs the s3 extra (pip install 'kvhal[s3]'): "
                        f"{exc}") from None
    return ObjTier(config, host, namespace)


@hookimpl
def kvhal_register_tiers():
    """Register the built-in tier types."""
    from .fs import FsTier
    from .memory import MemoryTier
    return [TierSpec("memory", MemoryTier), TierSpec("fs", FsTier), TierSpec("obj", obj_tier)]
