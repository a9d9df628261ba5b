"""Secondary tiers are refused only where vLLM's own block hashes are private to a process."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vllm is not installed in this environment")

from kvhal.config import ConfigError  # noqa: E402
from kvhal.integrations.vllm.geometry import Deployment, check_shareable  # noqa: E402


def _deployment(hash_name: str, seed: str | None) -> Deployment:
    return Deployment(groups=(), block_size=16, blocks_per_chunk=1, tp_size=1,
                      kv_dtype="bfloat16", hash_name=hash_name, hash_seed=seed)


def test_per_process_hashes_refuse_secondary_tiers():
    with pytest.raises(ConfigError, match=r"^secondary_tiers: vLLM's block hashes are random "
                       r"per process with --prefix-caching-hash-algo xxhash and PYTHONHASHSEED "
                       r"unset"):
        check_shareable(_deployment("xxhash", None), 1)


@pytest.mark.parametrize("hash_name, seed, tiers", [("xxhash", None, 0),
                                                    ("sha256", "vllm-none-hash", 1),
                                                    ("xxhash", "7", 2)],
                         ids=["host-only", "sha256-default", "xxhash-seeded"])
def test_shareable_hashes_accept_secondary_tiers(hash_name, seed, tiers):
    assert check_shareable(_deployment(hash_name, seed), tiers) is None
