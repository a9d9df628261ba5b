"""The obj secondary tier: verified chunk records as objects in any S3-compatible store."""
from .config import ObjConfig, StoreConfig, parse_config
from .tier import ObjTier

__all__ = ["ObjConfig", "ObjTier", "StoreConfig", "parse_config"]
