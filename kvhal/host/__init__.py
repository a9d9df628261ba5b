"""The host tier: the pinned region, its slots and their cache policies (DESIGN §5)."""
from .policy import ARCPolicy, CachePolicy, LRUPolicy
from .region import (PAGE_BYTES, HostGeometry, HostLayout, HostRegion, HostRegionError,
                     host_geometry, host_layout)
from .slots import IDLE, WRITING, SlotTable

__all__ = ["ARCPolicy", "CachePolicy", "HostGeometry", "HostLayout", "HostRegion",
           "HostRegionError", "IDLE", "LRUPolicy", "PAGE_BYTES", "SlotTable", "WRITING",
           "host_geometry", "host_layout"]
