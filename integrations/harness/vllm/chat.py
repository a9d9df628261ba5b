"""Multi-turn chat clients against a vLLM OpenAI server, for `kvhal bench serve`.

Each conversation is a client that sends its turns one after another, each only after the
previous turn's answer arrived, as a chat application does: the prompt of turn t+1 is the prompt
of turn t, then the answer to it, then the new user tokens. Prompts are token ids on
`/v1/completions` (the server runs with `--skip-tokenizer-init`), greedy, `ignore_eos` so every
answer has `answer_tokens` tokens, streamed so the time to the first token is seen. At most
`concurrency` requests are in flight across all conversations (a FIFO semaphore: a conversation
whose answer came back queues behind the others' turns, so every conversation stays live and
the working set is all of them). With `shared_prefix_tokens`, every conversation's first
prompt starts with the same tokens (one long system prompt shared by many sessions). Each
request names its conversation in OpenAI's `user` field (what a session-affinity router keys
on).

The HTTP client is aiohttp (a dependency of vLLM itself); the Server-Sent Events stream is read
line by line (`data: {...}` lines, then `data: [DONE]`).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

#: Lowest token id of generated user tokens (0-2 are special ids of the demo model).
FIRST_TOKEN_ID = 3


@dataclass(frozen=True, slots=True)
class ChatShape:
    """The workload's shape (token counts are the server's tokens).

    Attributes:
        conversations: Conversations, all live at once.
        turns: Requests per conversation.
        initial_tokens: User tokens of a conversation's first prompt.
        turn_tokens: New user tokens each later turn appends after the previous answer.
        answer_tokens: Tokens generated per request (`max_tokens`, with `ignore_eos`).
        concurrency: Most requests in flight at once, across conversations.
        seed: Seeds every conversation's user tokens (with its name).
        shared_prefix_tokens: Tokens every conversation's first prompt starts with, the same
            for all (`shared_prefix`), before its own `initial_tokens`.
    """

    conversations: int
    turns: int
    initial_tokens: int
    turn_tokens: int
    answer_tokens: int
    concurrency: int
    seed: int = 0
    shared_prefix_tokens: int = 0

    def longest_prompt(self) -> int:
        """Tokens of the last turn's prompt: what one conversation holds before its last
        answer."""
        return (self.shared_prefix_tokens + self.initial_tokens
                + (self.turns - 1) * (self.answer_tokens + self.turn_tokens))


def _tokens(seed_text: str, n: int, vocab_size: int) -> list[int]:
    digest = hashlib.sha256(seed_text.encode()).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    return rng.integers(FIRST_TOKEN_ID, vocab_size, n).tolist()


def user_tokens(shape: ChatShape, name: str, turn: int, vocab_size: int) -> list[int]:
    """The user tokens conversation `name` adds at `turn` (`initial_tokens` at turn 0,
    `turn_tokens` after): ints in [FIRST_TOKEN_ID, vocab_size), the same for the same seed,
    name and turn in every run and process."""
    n = shape.initial_tokens if turn == 0 else shape.turn_tokens
    return _tokens(f"{shape.seed}/{name}/{turn}", n, vocab_size)


def shared_prefix(shape: ChatShape, vocab_size: int) -> list[int]:
    """The `shape.shared_prefix_tokens` tokens every conversation's first prompt starts with:
    ints in [FIRST_TOKEN_ID, vocab_size), the same for the same seed in every run and process
    (empty without a shared prefix)."""
    return _tokens(f"{shape.seed}/shared-prefix", shape.shared_prefix_tokens, vocab_size)


def prompt_digest(tokens: list[int]) -> str:
    """A short digest naming a prompt's exact token ids (for comparing requests across runs)."""
    return hashlib.sha256(np.asarray(tokens, dtype=np.int64).tobytes()).hexdigest()[:16]


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it. Times are seconds after the run started.

    Attributes:
        conversation: The conversation's name.
        turn: 0-based turn.
        prompt_tokens: Prompt length in tokens.
        prompt_digest: `prompt_digest` of the prompt.
        sent_s: When the request was sent (after its semaphore slot was granted).
        first_token_s: When the first generated token arrived (None: none did).
        done_s: When the answer was complete or the request failed.
        token_ids: The generated token ids.
        cached_tokens: `usage.prompt_tokens_details.cached_tokens` (None: not reported).
        error: Why the request failed (None: it did not); "timeout" for a timeout.
    """

    conversation: str
    turn: int
    prompt_tokens: int
    prompt_digest: str
    sent_s: float
    first_token_s: float | None = None
    done_s: float | None = None
    token_ids: list[int] = field(default_factory=list)
    cached_tokens: int | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The result as a JSON-able dict (token ids included)."""
        return {k: getattr(self, k) for k in self.__slots__}


async def complete(session, url: str, body: dict, result: RequestResult, t0: float) -> None:
    """Send one streamed completion; fill `result` (first token, tokens, cached tokens,
    done time, or the error). Never raises for HTTP or protocol failures: they become
    `result.error`."""
    import aiohttp

    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {str(chunk['error'])[:200]}"
                    return
                for choice in chunk.get("choices") or ():
                    ids = choice.get("token_ids") or ()
                    if ids and result.first_token_s is None:
                        result.first_token_s = time.perf_counter() - t0
                    result.token_ids.extend(ids)
                usage = chunk.get("usage")
                if usage:
                    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens") or 0
        if len(result.token_ids) != body["max_tokens"]:
            result.error = (f"answer has {len(result.token_ids)} tokens, "
                            f"{body['max_tokens']} asked")
    except asyncio.TimeoutError:
        result.error = "timeout"
    except (aiohttp.ClientError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        result.done_s = time.perf_counter() - t0


async def run_chats(base_url: str, model: str, shape: ChatShape, *, vocab_size: int,
                    name_prefix: str = "c", timeout_s: float = 600.0,
                    extra_body: dict | None = None,
                    on_done: Callable[[RequestResult], None] | None = None
                    ) -> list[RequestResult]:
    """Run `shape.conversations` conversations against `base_url`; return every request's
    result, in completion order.

    Args:
        base_url: "http://host:port" of a vLLM OpenAI server.
        model: The served model name (`--model` of the server).
        name_prefix: Conversations are named `f"{name_prefix}{i}"`; the names seed the user
            tokens, so one prefix gives the same workload on every server.
        timeout_s: Limit on one request, from sending it to its last token; past it the request
            is cancelled and its result says "timeout".
        extra_body: Fields added to every request body.
        on_done: Called with each result as it completes (in the event loop's thread).

    A failed request ends its conversation: later turns need its answer.
    """
    import aiohttp

    url = f"{base_url}/v1/completions"
    sem = asyncio.Semaphore(shape.concurrency)
    results: list[RequestResult] = []
    t0 = time.perf_counter()

    prefix = shared_prefix(shape, vocab_size)

    async def conversation(session, name: str) -> None:
        prompt: list[int] = list(prefix)
        for turn in range(shape.turns):
            prompt = prompt + user_tokens(shape, name, turn, vocab_size)
            body = {"model": model, "prompt": prompt, "max_tokens": shape.answer_tokens,
                    "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                    "stream": True, "stream_options": {"include_usage": True},
                    "user": name, **(extra_body or {})}
            async with sem:
                result = RequestResult(name, turn, len(prompt), prompt_digest(prompt),
                                       time.perf_counter() - t0)
                try:
                    await asyncio.wait_for(complete(session, url, body, result, t0), timeout_s)
                except asyncio.TimeoutError:
                    result.error, result.done_s = "timeout", time.perf_counter() - t0
            results.append(result)
            if on_done is not None:
                on_done(result)
            if result.error is not None:
                return
            prompt = prompt + result.token_ids

    connector = aiohttp.TCPConnector(limit=shape.concurrency)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        await asyncio.gather(*(conversation(session, f"{name_prefix}{i}")
                               for i in range(shape.conversations)))
    return results
