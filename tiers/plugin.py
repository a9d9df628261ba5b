"""Entry point of the built-in secondary tiers (`kvhal` group)."""
from kvhal.hookspecs import hookimpl
from kvhal.plugins import TierSpec


@hookimpl
def kvhal_register_tiers():
    """Register the built-in tier types."""
    from .chunk_format import HEADER_BYTES
    from .fs import FsTier
    from .memory import MemoryTier
    return [TierSpec("memory", MemoryTier), TierSpec("fs", FsTier),
            TierSpec("p2p", p2p_tier, instance_keys=("data_parallel_index",)),
            TierSpec("obj", obj_tier), TierSpec("mooncake", mooncake_tier,
                                                host_tail_bytes=HEADER_BYTES)]


@hookimpl
def kvhal_add_commands(subparsers):
    """Add `kvhal fsck` (verify an fs tier folder or an obj tier bucket)."""
    from .fsck import register
    register(subparsers)


def _lazy(module: str, cls: str, extra: str):
    """A factory importing `cls` from `module` on first use, so a tier whose extra is not
    installed fails only when configured: `TierError` "type: the ... tier needs the ... extra"."""
    def factory(config, host, namespace, **kwargs):
        import importlib

        from kvhal.tier import TierError
        try:
            tier_cls = getattr(importlib.import_module(module, __package__), cls)
        except ImportError as exc:
            raise TierError(f"type: the {cls.removesuffix('Tier').lower()} tier needs the "
                            f"{extra} extra ({exc.name} missing): pip install "
                            f"'kvhal[{extra}]'") from None
        return tier_cls(config, host, namespace, **kwargs)
    factory.__doc__ = (f"Build a `{cls}` (imported on first use: it needs the `{extra}` "
                       "extra).\n\nRaises:\n    TierError: the extra is missing, or the tier's "
                       "own config errors.")
    return factory


p2p_tier = _lazy(".p2p", "P2PTier", "p2p")
obj_tier = _lazy(".obj", "ObjTier", "s3")
mooncake_tier = _lazy(".mooncake", "MooncakeTier", "mooncake")
