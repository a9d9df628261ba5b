"""The soak's load and its independent check.

Conversations come in groups; each group's token stream is played by two tenants (two
`cache_salt`s), so a tenant that could read the other's KV would show it. A conversation's
turn t+1 prompt is its turn-t prompt, the reference's answer to it, then new user tokens
(`chat.user_tokens`, seeded). Each request goes first to the keep-everything reference server,
then to a kvhal server chosen by the seed (so conversations move between servers and find
their KV in the shared tiers). Requests are greedy with `ignore_eos`, `logprobs` 2.

The check (`compare`): the same tokens and logprobs within `LOGPROB_TOL`; a token that differs
is a near tie (not wrong) only where the reference's two best logprobs there are within
`TIE_NATS` (prefill split differently between kvhal's hit and vLLM's own cache rounds bf16
differently, a real effect at near ties); anything else is a wrong answer.
"""
from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from ..vllm.chat import ChatShape, user_tokens

#: Largest |logprob| difference of a same-token answer still counted right (nats).
LOGPROB_TOL = 0.25
#: Reference top-2 logprob gap under which a different token is a near tie (nats).
TIE_NATS = 0.05
#: Seconds one request may take before the client gives up (a stopped server answers after
#: SIGCONT, well within it).
REQUEST_TIMEOUT_S = 120.0


@dataclass(slots=True)
class Conversation:
    """One tenant's copy of a group's conversation.

    Attributes:
        name: "r<round>g<group>".
        salt: The tenant's `cache_salt`.
        prompt: The next turn's prompt (token ids).
        turn: The next turn.
    """

    name: str
    salt: str
    prompt: list[int]
    turn: int = 0


@dataclass(slots=True)
class Request:
    """One request and its outcome (times in seconds after the load started)."""

    conversation: str
    salt: str
    turn: int
    server: int
    prompt_tokens: int
    sent_s: float
    done_s: float = 0.0
    reusable_tokens: int = 0        # longest prefix shared with an earlier prompt of the salt
    cached_tokens: int = 0
    #: Prompt tokens kvhal reports it served this request, by tier (its `kv_transfer_params`:
    #: `{"kvhal": {"hit_tokens": ...}}`, kvhal's own accounting, beside vLLM's count).
    kvhal_hit_tokens: dict = field(default_factory=dict)
    ref_cached_tokens: int = 0
    tries: int = 0
    error: str | None = None
    verdict: str = ""               # "ok", "near_tie", "wrong", "failed"
    wait_bound_s: float = float("inf")   # `checks.wait_bound_s`, set after the run
    max_logprob_diff: float = 0.0
    faults_during: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        """The request as a JSON-able dict."""
        return {k: getattr(self, k) for k in self.__slots__}


def conversations(seed: int, round_: int, groups: int, shape: ChatShape,
                  vocab_size: int) -> list[Conversation]:
    """Round `round_`'s conversations: `groups` groups × 2 tenants, seeded."""
    out = []
    for g in range(groups):
        first = user_tokens(shape, f"r{round_}g{g}", 0, vocab_size)
        out += [Conversation(f"r{round_}g{g}", f"s{seed}-g{g}-t{t}", list(first))
                for t in range(2)]
    return out


def order(seed: int, round_: int, convs: list[Conversation], turns: int
          ) -> list[tuple[Conversation, int]]:
    """Seeded (conversation, server) order of a round: each conversation's turns in order,
    interleaved with the others'; the server of each turn drawn at random."""
    rng = random.Random(f"{seed}/{round_}")
    left = {id(c): turns for c in convs}
    out = []
    while any(left.values()):
        c = rng.choice([c for c in convs if left[id(c)]])
        left[id(c)] -= 1
        out.append((c, rng.randrange(2)))
    return out


def complete(url: str, model: str, prompt: list[int], salt: str, max_tokens: int) -> dict:
    """One greedy completion; the decoded answer. Raises OSError (URLError, timeouts) or
    ValueError (an HTTP error answer, with its body; a non-JSON answer)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "logprobs": 2,
                       "return_token_ids": True, "return_tokens_as_token_ids": True,
                       "cache_salt": salt}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise ValueError(f"{url}: HTTP {e.code}: {e.read()[:500]!r}") from None


def answer_of(reply: dict) -> dict:
    """{token_ids, logprobs, top2_gap, cached_tokens, kvhal_hit_tokens} of a completion
    reply (the last: kvhal's hit tokens by tier from the reply's `kv_transfer_params`, {}
    from a server without kvhal)."""
    choice = reply["choices"][0]
    lp = choice.get("logprobs") or {}
    gaps = []
    for top in lp.get("top_logprobs") or []:
        vals = sorted((top or {}).values(), reverse=True)
        gaps.append(vals[0] - vals[1] if len(vals) > 1 else float("inf"))
    details = (reply.get("usage") or {}).get("prompt_tokens_details") or {}
    return {"token_ids": choice.get("token_ids") or [],
            "logprobs": lp.get("token_logprobs") or [], "top2_gap": gaps,
            "cached_tokens": details.get("cached_tokens") or 0,
            "kvhal_hit_tokens": dict(((reply.get("kv_transfer_params") or {}).get("kvhal")
                                      or {}).get("hit_tokens") or {})}


def compare(got: dict, ref: dict) -> tuple[str, float]:
    """("ok" | "near_tie" | "wrong", largest |logprob| difference over the agreeing prefix)
    (module docstring)."""
    diff = 0.0
    for i, (a, b) in enumerate(zip(got["token_ids"], ref["token_ids"])):
        if a != b:
            gap = ref["top2_gap"][i] if i < len(ref["top2_gap"]) else float("inf")
            return ("near_tie" if gap <= TIE_NATS else "wrong"), diff
        diff = max(diff, abs(got["logprobs"][i] - ref["logprobs"][i]))
    if len(got["token_ids"]) != len(ref["token_ids"]):
        return "wrong", diff
    return ("ok" if diff <= LOGPROB_TOL else "wrong"), diff


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def is_connection_error(exc: BaseException) -> bool:
    """Whether `exc` is a failure to reach or hear from a server (vs an HTTP error answer)."""
    return isinstance(exc, (urllib.error.URLError, ConnectionError, TimeoutError, OSError)) \
        and not isinstance(exc, urllib.error.HTTPError)


def now(t0: float) -> float:
    """Seconds since `t0` (monotonic)."""
    return time.monotonic() - t0
