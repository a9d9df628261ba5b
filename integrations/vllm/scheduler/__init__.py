"""The connector's scheduler side (`SchedulerSide`, `side.py`); its design is told there."""
from .side import (IDLE_WAIT_MAX_S, IDLE_WAIT_S, MAX_OFFLOAD_TOKENS, PHASES, REGION_NAME_PREFIX,
                   SchedulerSide, timeline)

__all__ = ["IDLE_WAIT_MAX_S", "IDLE_WAIT_S", "MAX_OFFLOAD_TOKENS", "PHASES",
           "REGION_NAME_PREFIX", "SchedulerSide", "timeline"]
