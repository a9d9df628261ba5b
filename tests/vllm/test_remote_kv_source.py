"""kvhal's scheduler side (`SchedulerSide`, real manager, real p2p tier, a peer in its own
process) answering vLLM for a load-balancing request (`remote_kv_source` names the peer to pull
from): vLLM is told of no hit before the peer said what it holds, then of exactly that.
"""
from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="the scheduler side imports vLLM (the `vllm` extra)")

from kvhal.config import parse_config  # noqa: E402
from kvhal.integrations.vllm.geometry import Deployment, GroupInfo  # noqa: E402
from kvhal.integrations.vllm.scheduler import SchedulerSide  # noqa: E402
from kvhal.layout import attention_spec, chunk_layout  # noqa: E402

from ..tiers.helpers import NAMESPACE, wait_for  # noqa: E402
from ..tiers.p2p_helpers import PeerProcess, config  # noqa: E402

BLOCK = 64
#: Canonical bytes of one 64-token block of 2 fp16 layers of 2 KV heads of 64: 64 KiB.
CHUNK = 2 * 2 * BLOCK * 2 * 64 * 2


def _deployment() -> Deployment:
    spec = attention_spec(num_layers=2, num_kv_heads=2, head_size=64, dtype="fp16",
                          block_size=BLOCK)
    group = GroupInfo(0, spec, ("layer.0", "layer.1"), chunk_layout(spec, 1).chunk_bytes)
    assert group.chunk_nbytes == CHUNK
    # vLLM's default sha256 seed, as `get_none_hash_seed` reports it: the hash check passes
    return Deployment((group,), BLOCK, 1, 1, "fp16", "sha256", "vllm-none-hash", "LBHNC")


@pytest.fixture
def peer():
    """A p2p peer process holding chunks 0-2 (`tests.tiers.p2p_peer`'s keys and bytes)."""
    proc = PeerProcess(config(), count=3, nbytes=CHUNK)
    yield proc
    proc.kill()


def test_vllm_is_asked_to_wait_until_the_named_peer_answered_then_hits_what_it_holds(peer):
    """The request's 5 full chunks (a 321-token prompt): the peer holds chunks 0-2. The first
    `get_num_new_matched_tokens` answers (None, False), vLLM's "ask me again" (the p2p tier
    is asking the peer; no hit is claimed), and once the peer answered, a 192-token
    asynchronous hit (chunks 0-2, being pulled). Seen failing with the manager answering a
    tier's RETRY as RETRY (as before the fix): the first answer claimed all 5 chunks,
    `(320, True) == (None, False)`, and the pulls of chunks 3-4 would have failed late; and
    with `_hit_end` not deferring on UNDECIDED: `(320, False) == (None, False)` (a
    synchronous hit of chunks not in host memory)."""
    host, port = peer.address
    side = SchedulerSide(_deployment(), parse_config(
        {"cpu_bytes_to_use": 16 * CHUNK, "secondary_tiers": [config()]}), "test-remote-source",
        NAMESPACE)
    request = SimpleNamespace(
        request_id="r1", num_tokens=5 * BLOCK + 1, num_prompt_tokens=5 * BLOCK + 1,
        num_computed_tokens=0, skip_reading_prefix_cache=False,
        block_hashes=[hashlib.sha256(i.to_bytes(8, "little")).digest() for i in range(5)],
        kv_transfer_params={"remote_kv_source": {"kv_request_id": "lb-1", "remote_host": host,
                                                 "remote_port": port}})
    try:
        first = side.get_num_new_matched_tokens(request, 0)
        answers = [first]

        def decided():
            answers.append(side.get_num_new_matched_tokens(request, 0))
            return answers[-1] != (None, False)
        wait_for(decided, 10, "the peer's answer")

        assert first == (None, False)
        assert answers[-1] == (3 * BLOCK, True)
    finally:
        side.request_finished(request)
        side.close()
