"""The mooncake secondary tier: verified chunk records in a Mooncake Store memory pool."""
from .config import MooncakeConfig, parse_config
from .tier import MooncakeTier

__all__ = ["MooncakeConfig", "MooncakeTier", "parse_config"]
