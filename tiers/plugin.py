"""Entry point of the built-in secondary tiers (`kvhal` group)."""
from kvhal.hookspecs import hookimpl
from kvhal.plugins import TierSpec


@hookimpl
def kvhal_register_tiers():
    """Register the built-in tier types."""
    from .fs import FsTier
    from .memory import MemoryTier
    return [TierSpec("memory", MemoryTier), TierSpec("fs", FsTier), TierSpec("p2p", p2p_tier),
            TierSpec("obj", obj_tier)]


def p2p_tier(config, host, namespace, **kwargs):
    """Build a `P2PTier`, imported on first use: it needs the `p2p` extra (msgpack).

    Raises:
        TierError: msgpack is not installed (`type: ...`), or the tier's own config errors.
    """
    from .base import TierError
    try:
        from .p2p import P2PTier
    except ImportError as exc:
        raise TierError(f"type: the p2p tier needs the p2p extra ({exc.name} missing): "
                        "pip install 'kvhal[p2p]'") from None
    return P2PTier(config, host, namespace, **kwargs)


def obj_tier(config, host, namespace):
    """Build an `ObjTier`, imported on first use: it needs the `s3` extra (obstore, boto3).

    Raises:
        TierError: obstore is not installed (`type: ...`), or the tier's own config errors.
    """
    from .base import TierError
    try:
        from .obj import ObjTier
    except ImportError as exc:
        raise TierError(f"type: the obj tier needs the s3 extra ({exc.name} missing): "
                        "pip install 'kvhal[s3]'") from None
    return ObjTier(config, host, namespace)
