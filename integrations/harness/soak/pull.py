"""The `p2p_kill_mid_pull` fault's request: one server asked for KV the other one holds, while
that other one is killed.

The soak's driver records the last prompt each server answered (`PullProbe.served`). The fault
sends that prompt (same tenant salt) to the other server, the puller, whose p2p tier follows
the holder's host tier (p2p is the puller's first secondary tier); `faults.PULL_KILL_S` later
the holder is SIGKILLed (a timing approximation of "mid-pull": the pull's start is not
observed; an answer faster than that is reported, and the holder killed all the same). The answer is checked against
the reference like every other (`load.compare`) and recorded as a request of the run; the
chunks the puller's kvhal loaded over p2p meanwhile (its `/metrics`, before and after) say
whether a pull landed.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from ..vllm.serve_metrics import delta, loaded_by_tier
from . import faults as faultlib
from .fleet import scrape
from .load import Request, answer_of, compare, complete, now


class PullProbe:
    """Callable as the Faulter's `probe(holder, puller, kill)`; appends its request to
    `requests`.

    Args:
        reference_url: The keep-everything server.
        servers: The kvhal servers (`fleet.Server`).
        model: Model folder (the request's `model`).
        answer_tokens: Tokens each answer has.
        requests: The run's request list.
        t0: The load's start (monotonic seconds).
    """

    def __init__(self, reference_url: str, servers: list, model: Path, answer_tokens: int,
                 requests: list, t0: float):
        self.reference_url, self.servers, self.model = reference_url, servers, str(model)
        self.answer_tokens, self.requests, self.t0 = answer_tokens, requests, t0
        self.served: list[tuple[str, str, list[int]] | None] = [None, None]

    def __call__(self, holder: int, puller: int, kill: Callable[[], str]) -> str:
        last = self.served[holder]
        if last is None:
            return "skipped: the holder answered nothing yet"
        name, salt, prompt = last
        ref = answer_of(complete(self.reference_url, self.model, prompt, salt,
                                 self.answer_tokens))
        req = Request(name + "/pull", salt, -1, puller, len(prompt), now(self.t0))
        req.reusable_tokens, req.ref_cached_tokens, req.tries = len(prompt), ref["cached_tokens"], 1
        url = self.servers[puller].url
        before = scrape(url)
        got: dict = {}

        def ask() -> None:
            try:
                got["answer"] = answer_of(complete(url, self.model, prompt, salt,
                                                   self.answer_tokens))
            except Exception as e:  # noqa: BLE001 - recorded as the request's error
                got["error"] = f"{type(e).__name__}: {e}"

        thread = threading.Thread(target=ask, name="soak-pull", daemon=True)
        thread.start()
        thread.join(faultlib.PULL_KILL_S)
        mid = thread.is_alive()
        killed = kill() + ("" if mid else " after the answer came (not mid-pull)")
        thread.join()
        req.done_s = now(self.t0)
        p2p = loaded_by_tier(delta(before, scrape(url))).get("p2p", 0)
        if "answer" in got:
            req.cached_tokens = got["answer"]["cached_tokens"]
            req.kvhal_hit_tokens = got["answer"]["kvhal_hit_tokens"]
            req.verdict, req.max_logprob_diff = compare(got["answer"], ref)
        else:
            req.verdict, req.error = "failed", got.get("error")
        req.faults_during = ["pulling during p2p_kill_mid_pull"]   # its server was not killed
        self.requests.append(req)
        return (f"{self.servers[puller].name} asked for {len(prompt)} tokens "
                f"{self.servers[holder].name} holds; {killed}; chunks it loaded over p2p {p2p}, "
                f"verdict {req.verdict}")
