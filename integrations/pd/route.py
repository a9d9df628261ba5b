"""Which instance of a fleet serves a request: the routing policies of `kvhal proxy --route`.

Policies (`POLICIES`):
- "round-robin": the healthy instances in turn, blind to load and KV.
- "affinity": one conversation, one instance (session affinity): the first request of a
  conversation goes to the least-loaded instance, later ones to the same instance while it is
  healthy. Conversation = the body's OpenAI `user` field, else a hash of the first chat
  message or of the prompt's first `AFFINITY_TOKENS` tokens (or characters).
- "kv": KV-aware and load-aware. Each healthy instance's cost, in prompt-token units, is
  `RECOMPUTE_CHARGE * computed + loading + pending + load_tokens * load`: `computed` = the
  prompt tokens beyond the prefix it holds (charged twice: they delay this request and take
  capacity from every later one); `loading` = what loading the held prefix costs, each
  tier's tokens times one minus its `TIER_WEIGHTS` (device 1.0 > host 0.8 > disk 0.6 >
  shared 0.4: the share of recomputation a hit there saves); `pending` = the prompt tokens
  the router predicted its requests in flight compute, hits not counted (as Dynamo's KV router counts an instance's pending
  prefill blocks; a load runs beside the engine's steps, a computed token in them); `load` =
  its requests in flight by the proxy's own count or, when larger, the running + waiting
  requests its `/metrics` reported at the last poll, each weighing `load_tokens` (its decode
  steps, and the prompts of requests another client sent). Least cost wins; ties go to the
  lesser load, then in turn.
- "kv-p2p": "kv", and an instance may also count the prefix a busy holder (load >=
  `p2p_busy`) keeps in its host tier, weighted `P2P_WEIGHT`, when the holder's p2p address is
  known: if such an instance wins by that credit, the request carries
  `kv_transfer_params.remote_kv_source` `{"kv_request_id", "remote_host", "remote_port"}`
  naming the holder (kvhal's p2p tier, `tiers/p2p/orchestration.py`: the instance asks the
  holder which chunks it has and pulls them instead of recomputing). Only beyond
  `p2p_min_tokens` of the instance's own prefix.
Fallback ("fallback" reason): no prompt tokens known (a text prompt without a working
tokenizer, a batch of prompts) in the kv policies: round-robin among the least loaded.
Reasons counted per instance: "kv" (chosen holding a prefix), "load" (no instance held any,
chosen by load), "p2p", "fallback", "affinity", "round-robin".
"""
from __future__ import annotations

import argparse
import hashlib
import json
import secrets
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .backends import Backend, NoHealthyBackend, P2PAddress, backend_url
from .prefix_index import TIERS, InstanceIndex, prefix_keys, root_key

POLICIES = ("round-robin", "affinity", "kv", "kv-p2p")
#: Share of a token's recomputation that a hit in each tier saves (module docstring).
TIER_WEIGHTS = {"device": 1.0, "host": 0.8, "disk": 0.6, "shared": 0.4}
#: What a token this request computes costs against a queued one: it delays this request
#: and also takes capacity from every later one (a queued token delays only this request).
RECOMPUTE_CHARGE = 2.0
#: Weight of a token pulled from a peer's host tier over p2p.
P2P_WEIGHT = 0.5
#: Prompt tokens (or characters) naming a conversation when it has no `user`.
AFFINITY_TOKENS = 256
#: Conversations the affinity policy remembers (oldest forgotten first).
MAX_CONVERSATIONS = 100_000
REMOTE_KV_SOURCE = "remote_kv_source"

if TYPE_CHECKING:       # pyzmq and msgspec are imported only when fleet mode runs
    from .events_sub import EventFeed


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """`--instance URL[,events=ZMQ_ENDPOINT][,replay=ZMQ_ENDPOINT][,p2p=HOST:PORT]`."""

    url: str
    events: str | None = None
    replay: str | None = None
    p2p: P2PAddress | None = None


def parse_instance(spec: str) -> InstanceSpec:
    """Parse one `--instance` SPEC.

    Raises:
        argparse.ArgumentTypeError: an unknown key, a repeated key, a bad URL, endpoint or
            p2p address (the message quotes `spec`).
    """
    url, *parts = spec.split(",")
    fields: dict[str, str] = {}
    for part in parts:
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or key not in ("events", "replay", "p2p") or key in fields or not value:
            raise argparse.ArgumentTypeError(
                f"--instance {spec!r}: {part!r} is not one of events=ZMQ_ENDPOINT, "
                f"replay=ZMQ_ENDPOINT, p2p=HOST:PORT (each at most once)")
        fields[key] = value.strip()
    for key in ("events", "replay"):
        if key in fields:
            _check_endpoint(spec, key, fields[key])
    if "replay" in fields and "events" not in fields:
        raise argparse.ArgumentTypeError(f"--instance {spec!r}: replay= needs events=")
    p2p = None
    if "p2p" in fields:
        host, _, port = fields["p2p"].rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise argparse.ArgumentTypeError(f"--instance {spec!r}: p2p must be HOST:PORT "
                                             f"with PORT in 1..65535, got {fields['p2p']!r}")
        p2p = P2PAddress(host.strip("[]"), int(port))
    return InstanceSpec(backend_url(url), fields.get("events"), fields.get("replay"), p2p)


def _check_endpoint(spec: str, key: str, endpoint: str) -> None:
    """Refuse an endpoint a ZMQ socket cannot connect to (found here, not by a feed task
    failing after startup): tcp://HOST:PORT with a real host (vLLM's publisher binds
    `tcp://*:PORT`; the router connects to the instance's host) or ipc://PATH.

    Raises:
        argparse.ArgumentTypeError: naming `key` and quoting `spec`.
    """
    scheme, _, address = endpoint.partition("://")
    if scheme == "ipc" and address:
        return
    if scheme != "tcp":
        raise argparse.ArgumentTypeError(f"--instance {spec!r}: {key} must be a ZMQ "
                                         f"endpoint tcp://HOST:PORT or ipc://PATH")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"--instance {spec!r}: {key} must be "
                                         f"tcp://HOST:PORT with PORT in 1..65535, got "
                                         f"{endpoint!r}")
    if host.strip("[]") in ("*", "0.0.0.0", "::"):
        raise argparse.ArgumentTypeError(
            f"--instance {spec!r}: {key}={endpoint} is the publisher's bind address; "
            f"connect to the instance's host, e.g. tcp://10.0.0.5:{port}")


@dataclass(slots=True)
class Instance:
    """One fleet instance: its backend (health, requests in flight), index, event feed,
    polled queue and routing counters."""

    spec: InstanceSpec
    backend: Backend
    index: InstanceIndex = field(default_factory=InstanceIndex)
    feed: EventFeed | None = None
    queued: int = 0     # running + waiting at the last /metrics poll
    pending: int = 0    # prompt tokens its requests in flight are predicted to compute
    by_reason: Counter = field(default_factory=Counter)
    predicted: Counter = field(default_factory=Counter)

    @property
    def load(self) -> int:
        """Requests in flight: the proxy's count, or the polled queue when larger."""
        return max(self.backend.outstanding, self.queued)

    def describe(self) -> dict:
        """State and counters as `/router/stats` shows them (JSON-ready)."""
        return self.backend.describe() | {
            "events": None if self.feed is None else self.feed.to_dict(),
            "p2p": None if self.spec.p2p is None else
            f"{self.spec.p2p.host}:{self.spec.p2p.port}",
            "in_flight": self.backend.outstanding, "load": self.load, "queued": self.queued,
            "pending_tokens": self.pending,
            "routed": sum(self.by_reason.values()),
            "by_reason": {r: self.by_reason[r] for r in
                          ("kv", "load", "p2p", "fallback", "affinity", "round-robin")},
            "predicted_hit_tokens": {t: self.predicted[t] for t in (*TIERS, "p2p")},
            "index_blocks": self.index.counts()}


@dataclass(frozen=True, slots=True)
class Decision:
    """Where one request goes.

    Attributes:
        instance: The chosen instance.
        reason: Why (module docstring).
        predicted: Prompt tokens it is predicted to reuse, per tier and "p2p".
        kv_transfer: Keys to merge into the request's `kv_transfer_params` (kv-p2p).
        expects_store: The prompt is a block longer than its predicted device prefix (its
            instance must publish a `BlockStored`).
        compute: Prompt tokens it is predicted to compute, no hit counted (0 where the
            policy does not predict); in the instance's `pending` until `Router.finished`.
    """

    instance: Instance
    reason: str
    predicted: dict[str, int]
    kv_transfer: dict[str, Any] | None = None
    expects_store: bool = False
    compute: int = 0


class Router:
    """Chooses an instance per request (module docstring); event-loop only, no locks.

    Args:
        instances: The fleet, in `--instance` order.
        policy: One of `POLICIES`.
        load_tokens: Prompt tokens one request in flight weighs against a prefix hit.
        p2p_busy: Load at which a holder counts as busy (kv-p2p).
        p2p_min_tokens: Fewest tokens worth pulling over p2p.
    """

    def __init__(self, instances: list[Instance], policy: str, *, load_tokens: int = 128,
                 p2p_busy: int = 2, p2p_min_tokens: int = 256):
        if policy not in POLICIES:
            raise ValueError(f"policy: must be one of {', '.join(POLICIES)}, got {policy!r}")
        if not instances:
            raise ValueError("no instance given")
        self.instances, self.policy = instances, policy
        self.load_tokens, self.p2p_busy, self.p2p_min_tokens = (load_tokens, p2p_busy,
                                                                p2p_min_tokens)
        self._turn = 0
        self._conversations: OrderedDict[str, Instance] = OrderedDict()

    def live(self, exclude: tuple[Instance, ...] = ()) -> list[Instance]:
        """Healthy instances (never-polled count as healthy) not in `exclude`, starting at the
        round-robin turn.

        Raises:
            NoHealthyBackend: none.
        """
        n = len(self.instances)
        order = [self.instances[(self._turn + i) % n] for i in range(n)]
        live = [i for i in order if i.backend.healthy is not False and i not in exclude]
        if not live:
            raise NoHealthyBackend("instance", [i.backend for i in self.instances])
        return live

    def choose(self, tokens: list[int] | None, conversation: str | None,
               exclude: tuple[Instance, ...] = (), cache_salt: str | None = None) -> Decision:
        """The instance for a request with prompt `tokens` (None: unknown) and vLLM
        `cache_salt` in `conversation`, among healthy ones not in `exclude`; counts it
        (`by_reason`,
        `predicted`, the backend's `outstanding` and `legs`: end with `Pool.done`).

        Raises:
            NoHealthyBackend: no healthy instance is left.
        """
        live = self.live(exclude)
        if self.policy == "round-robin":
            decision = Decision(live[0], "round-robin", {})
        elif self.policy == "affinity":
            decision = self._affinity(live, conversation)
        elif tokens is None:
            decision = Decision(self._least_loaded(live), "fallback", {})
        else:
            decision = self._kv(live, tokens, cache_salt)
        chosen = decision.instance
        self._turn = (self.instances.index(chosen) + 1) % len(self.instances)
        chosen.by_reason[decision.reason] += 1
        chosen.predicted.update(decision.predicted)
        chosen.pending += decision.compute
        chosen.backend.outstanding += 1
        chosen.backend.legs += 1
        return decision

    @staticmethod
    def finished(decision: Decision) -> None:
        """Its request ended (answered, failed or sent on): its predicted compute leaves the
        instance's `pending`."""
        decision.instance.pending -= decision.compute

    @staticmethod
    def _least_loaded(live: list[Instance]) -> Instance:
        return min(live, key=lambda i: i.load)

    def _affinity(self, live: list[Instance], conversation: str | None) -> Decision:
        if conversation is None:
            return Decision(self._least_loaded(live), "fallback", {})
        held = self._conversations.get(conversation)
        if held is None or held not in live:
            held = self._least_loaded(live)
        self._conversations[conversation] = held
        self._conversations.move_to_end(conversation)
        if len(self._conversations) > MAX_CONVERSATIONS:
            self._conversations.popitem(last=False)
        return Decision(held, "affinity", {})

    def _kv(self, live: list[Instance], tokens: list[int], cache_salt: str | None
            ) -> Decision:
        longest = max(i.index.longest for i in live)     # no key beyond it can be held
        keys = prefix_keys(tokens[:longest], root_key((cache_salt,) if cache_salt else None))
        hits = {id(i): i.index.hits(keys) for i in live}
        holder, pull = None, 0
        if self.policy == "kv-p2p":
            for i in live:
                held = i.index.prefix(keys, "host")
                if i.spec.p2p is not None and i.load >= self.p2p_busy and held > pull:
                    holder, pull = i, held
        n = len(tokens)
        best = None
        for i in live:      # in round-robin order: the first of equal costs wins
            hit = hits[id(i)]
            own = sum(hit.values())
            extra = 0
            if holder is not None and i is not holder and pull - own >= self.p2p_min_tokens:
                extra = pull - own
            # this request's own work there, then what is queued before it
            computed = n - own - extra
            loading = (sum((1 - TIER_WEIGHTS[t]) * hit[t] for t in TIERS)
                       + (1 - P2P_WEIGHT) * extra)
            rank = (RECOMPUTE_CHARGE * computed + loading + i.pending
                    + self.load_tokens * i.load, i.load)
            if best is None or rank < best[0]:
                best = (rank, i, hit, extra)
        _, chosen, hit, extra = best
        predicted = {t: v for t, v in hit.items() if v} | ({"p2p": extra} if extra else {})
        block = chosen.index.min_block_tokens or 16
        expects = n - hit["device"] >= block + 1
        compute = max(0, n - sum(predicted.values()))
        if extra:
            source = {"kv_request_id": secrets.token_urlsafe(24),
                      "remote_host": holder.spec.p2p.host, "remote_port": holder.spec.p2p.port}
            return Decision(chosen, "p2p", predicted, {REMOTE_KV_SOURCE: source}, expects,
                            compute)
        reason = "kv" if any(hit.values()) else "load"
        return Decision(chosen, reason, predicted, None, expects, compute)


def conversation_of(body: dict, tokens: list[int] | None) -> str | None:
    """The conversation a request belongs to, for the affinity policy (module docstring);
    None when the body names none (no user, no messages, no prompt)."""
    user = body.get("user")
    if isinstance(user, str) and user:
        return f"user:{user}"
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        first = json.dumps(messages[0], sort_keys=True, default=str)
    elif tokens:
        first = json.dumps(tokens[:AFFINITY_TOKENS])
    elif isinstance(body.get("prompt"), str):
        first = body["prompt"][:AFFINITY_TOKENS]
    else:
        return None
    return "hash:" + hashlib.blake2b(first.encode(), digest_size=16).hexdigest()
