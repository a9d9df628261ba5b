"""The fs secondary tier: one verified file per chunk in a folder shared by processes."""
from .config import FsConfig, parse_config
from .tier import FsTier

__all__ = ["FsConfig", "FsTier", "parse_config"]
