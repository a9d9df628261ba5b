"""Lookup and hit accounting: how many tokens of a request kvhal can load, and from where.

Every KV cache group of vLLM (hybrid models: full attention, sliding window, MLA, Mamba /
linear-attention state) has its own chunk keys (`ChunkKey.group`), its own host pool and its
own lookup rule (`kvhal.engine.needed_chunks`): a hit is the longest chunk prefix every group
can serve (a chunk being promoted from a secondary tier counts: it is on its way; one a tier
cannot tell about yet, `Lookup.UNDECIDED`, defers the request's lookup to a later step).
A hit pins its resident chunks (`Manager.lookup` with the request's pin owner (request id,
group)) until its load is planned or the request is not scheduled (`release`).
"""
from __future__ import annotations

import collections
import time
from typing import Any, Sequence

from kvhal.engine import Manager, needed_chunks, prefix_hit
from kvhal.layout import Kind
from kvhal.tier import Lookup

from ..events import ChunkEvents
from ..geometry import Deployment, check_vllm_hash_seed
from .requests import RequestTable


class StepTimer:
    """vLLM's step timings for the cost model's prefill estimate (`kvhal.engine.cost`): a
    step's seconds run from `build_connector_meta` (the scheduler's output is final) to the
    `update_connector_output` of its model output, in order (vLLM 0.32 calls both once per
    step: `Scheduler.schedule`, `update_from_output`); its tokens are the step's
    `total_num_scheduled_tokens`. Under asynchronous scheduling a step also waits for the one
    before it, which makes prefill look slower and only favours loading."""

    #: Steps awaiting their output at most (more means a missed output: start over).
    MAX_OPEN = 4

    def __init__(self, manager: Manager):
        self._cost = manager.cost
        self._open: collections.deque[tuple[float, int]] = collections.deque()

    def scheduled(self, num_tokens: int) -> None:
        """A step of `num_tokens` tokens was scheduled now."""
        if len(self._open) >= self.MAX_OPEN:
            self._open.clear()
        self._open.append((time.perf_counter(), num_tokens))

    def finished(self) -> None:
        """The oldest open step's model output arrived now."""
        if self._open:
            started, num_tokens = self._open.popleft()
            self._cost.observe_prefill(num_tokens, time.perf_counter() - started)


class HitLookup:
    """Answers vLLM's "how many tokens can you load" and credits hit tokens to their tiers.

    Args:
        deployment: Geometry and KV cache groups.
        manager: The engine's manager (lookups, pins, promotions).
        requests: The live requests (states, chunk keys).
        chunk_events: Where promoted chunks are described for KV events, or None.

    Attributes:
        asked: Requests looked up this step and not (yet) allocated.
        deciding: Requests whose last lookup was undecided: vLLM asks again.
        steps: vLLM's step timings, for the cost model (`StepTimer`).
    """

    def __init__(self, deployment: Deployment, manager: Manager, requests: RequestTable,
                 chunk_events: ChunkEvents | None):
        self._deployment = deployment
        self._manager = manager
        self._requests = requests
        self._chunk_events = chunk_events
        self._prefix_groups = [g for g in deployment.groups
                               if g.kind in (Kind.FULL, Kind.MLA)]
        # groups that need only part of a hit's prefix: a window, or the state at its end
        self._partial_groups = [g for g in deployment.groups
                                if g.kind not in (Kind.FULL, Kind.MLA)]
        # tier label → vLLM CacheHitSource value of the tokens it serves
        self._hit_source = {"host": "host", **{label: tier.hit_source for label, tier in
                                               zip(manager.tier_labels, manager.tiers)}}
        self._seed_checked = False
        self.asked: set[str] = set()
        self.deciding: set[str] = set()
        self.steps = StepTimer(manager)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Tokens beyond `num_computed_tokens` kvhal can load (whole chunks only, and never the
        prompt's last token, which vLLM must compute), and whether the load is asynchronous:
        True with several groups (`Deployment.async_loads`) or when a chunk of the hit is
        still on its way into host memory (a promotion from a secondary tier, a store in
        flight). (None, False) while a secondary tier cannot tell yet whether it holds a chunk
        the hit needs (`Lookup.UNDECIDED`, e.g. a p2p tier asking the peer a request names):
        vLLM skips the request this step and asks again on a later one (vLLM's connector API:
        "needs more time to determine the number of matched tokens"), so a chunk the tier
        then finds absent is never claimed and failed late.

        With blocks_per_chunk > 1, a local prefix hit that ends inside a chunk gets no external
        hit (loads start at chunk boundaries); vLLM-CPU's 128-token blocks make 1 the default.

        (0, False) without looking anything up (nothing is promoted or pinned) for a request
        vLLM computes in full whatever is cached (`Request.skip_reading_prefix_cache`, set for
        prompt logprobs); its chunks are still stored. Likewise, storing nothing either, for a
        request whose LoRA adapter kvhal cannot fingerprint (`RequestTable.state`).
        """
        if not self._seed_checked:  # vLLM seeds its hashes after building the connector
            check_vllm_hash_seed(self._deployment)
            self._seed_checked = True
        state = self._requests.state(request)
        if request.skip_reading_prefix_cache or not state.reuse:
            return 0, False
        state.times.setdefault("lookup", time.time())
        tpc = self._deployment.tokens_per_chunk
        start = -(-num_computed_tokens // tpc)
        end = (request.num_tokens - 1) // tpc
        if state.max_hit_chunks is not None:
            end = min(end, state.max_hit_chunks)
        if start * tpc != num_computed_tokens or start >= end:
            return 0, False
        self.asked.add(request.request_id)
        found = self._hit_end(request, start, end)
        if found is None:
            self.deciding.add(request.request_id)
            return None, False
        self.deciding.discard(request.request_id)
        hit_end, pending = found
        state.load_start, state.load_end = start, hit_end
        if hit_end == start:
            return 0, False
        state.async_hit = pending or self._deployment.async_loads
        return (hit_end - start) * tpc, state.async_hit

    def _hit_end(self, request: Any, start: int, end: int) -> tuple[int, bool] | None:
        """The end chunk of the longest hit in [start, end) every group can serve (pins its
        resident chunks), and whether a chunk of it is still on its way into host memory; None
        if a chunk that hit needs is UNDECIDED (every group was asked first, so each tier
        that cannot tell yet is finding out meanwhile)."""
        request_id, dep, manager = request.request_id, self._deployment, self._manager
        limit, pending, undecided = end, False, False
        for g in self._prefix_groups:   # whole prefix: the chunks before the first MISS
            keys = self._requests.keys(request, g.group_id)[start:end]
            answers = manager.lookup(keys, pin_owner=(request_id, g.group_id),
                                     request_id=request_id)
            self._describe(request, start, keys, answers)
            hit = prefix_hit(answers)
            pending = pending or hit.pending
            undecided = undecided or hit.undecided
            limit = min(limit, start + hit.num_chunks)
        if not self._partial_groups:
            return None if undecided else (limit, pending)
        keys = {g.group_id: self._requests.keys(request, g.group_id)
                for g in self._partial_groups}
        probed: dict[tuple[int, int], Lookup] = {}

        def answer(group: int, chunk: int) -> Lookup:
            if (group, chunk) not in probed:  # each chunk once per call (promotions start once)
                probed[group, chunk] = manager.lookup([keys[group][chunk]],
                                                      request_id=request_id)[0]
                if probed[group, chunk] is Lookup.RETRY:
                    self._describe(request, chunk, [keys[group][chunk]], [Lookup.RETRY])
            return probed[group, chunk]

        hit_end = start
        for n in range(limit, start, -1):  # window and state groups: from the longest down
            need = [(g.group_id, c) for g in self._partial_groups for c in reversed(
                needed_chunks(g.kind, start, n, dep.tokens_per_chunk, dep.block_size,
                              g.sliding_window))]
            if all(answer(group, chunk) is not Lookup.MISS for group, chunk in need):
                hit_end = n
                pending = pending or any(probed[k] is Lookup.RETRY for k in need)
                undecided = undecided or any(probed[k] is Lookup.UNDECIDED for k in need)
                break
        if undecided:
            return None
        for g in self._partial_groups:
            rng = needed_chunks(g.kind, start, hit_end, dep.tokens_per_chunk, dep.block_size,
                                g.sliding_window)
            manager.lookup([keys[g.group_id][c] for c in rng],
                           pin_owner=(request_id, g.group_id), request_id=request_id)
        return hit_end, pending

    def _describe(self, request: Any, start: int, keys: list, answers: list) -> None:
        """Describe the chunks being promoted (from chunk `start` on) for their KV events."""
        if self._chunk_events is not None:
            for i, (key, answer) in enumerate(zip(keys, answers)):
                if answer is Lookup.RETRY:
                    self._chunk_events.record(key, request, start + i)

    def release(self, request_id: str) -> None:
        """Drop the lookup pins of `request_id` in every group."""
        for g in self._deployment.groups:
            self._manager.release((request_id, g.group_id))

    def release_unscheduled(self) -> None:
        """Drop the pins of the requests asked about this step but not scheduled."""
        for request_id in self.asked:
            self.release(request_id)
        self.asked.clear()

    def forget(self, request_id: str) -> None:
        """A finished request: drop its pins; it is no longer asked about or deciding."""
        self.release(request_id)
        self.asked.discard(request_id)
        self.deciding.discard(request_id)

    def credit(self, into: dict[str, int], labels: Sequence[str], source: bool = False
               ) -> None:
        """Add a chunk's tokens to `into` per tier label in `labels` (by vLLM cache-hit
        source if `source`)."""
        tpc = self._deployment.tokens_per_chunk
        for label in labels:
            name = self._hit_source[label] if source else label
            into[name] = into.get(name, 0) + tpc
