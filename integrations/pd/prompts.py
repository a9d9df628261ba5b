"""A request's prompt as token ids, for fleet routing.

Token-id prompts (`"prompt": [ids]`) are used as they are. Text prompts are tokenized with the
model's tokenizer (transformers' `AutoTokenizer`, from `--tokenizer DIR`) as vLLM's completions
endpoint does (special tokens added); chat messages with its chat template and the generation
prompt, as vLLM's chat endpoint does by default. A tokenizer that cannot load is logged once
at startup (an error naming the folder and why); a chat template that fails is logged once.
Both then give None: the router routes those requests by its fallback (round-robin among the
least loaded), never failing them.
"""
from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("kvhal.proxy.prompts")


class Prompts:
    """Turns request bodies into prompt token ids.

    Args:
        tokenizer_dir: A folder or hub name `AutoTokenizer.from_pretrained` accepts, or None
            (text prompts then have no tokens).
    """

    def __init__(self, tokenizer_dir: str | None):
        self.tokenizer = None
        self.problem: str | None = None if tokenizer_dir else "no --tokenizer given"
        self._warned_chat = False
        if tokenizer_dir:
            try:
                from transformers import AutoTokenizer
                self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
            except Exception as exc:     # noqa: BLE001 - any failure: fall back, never crash
                self.problem = (f"tokenizer {tokenizer_dir!r} cannot load "
                                f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})")
                log.error("%s; text prompts and chat messages are routed round-robin among "
                          "the least loaded (token-id prompts stay KV-aware)", self.problem)

    def tokens(self, body: dict[str, Any], *, chat: bool) -> list[int] | None:
        """The prompt's token ids, or None when they are not known (module docstring)."""
        if chat:
            messages = body.get("messages")
            if self.tokenizer is None or not isinstance(messages, list):
                return None
            try:
                ids = self.tokenizer.apply_chat_template(messages, tokenize=True,
                                                         add_generation_prompt=True)
            except Exception as exc:     # noqa: BLE001 - a template error must not fail it
                if not self._warned_chat:
                    self._warned_chat = True
                    log.warning("chat template failed (%s: %s); chat requests are routed "
                                "without their tokens", type(exc).__name__, exc)
                return None
            if isinstance(ids, dict):     # transformers 5 returns a BatchEncoding
                ids = ids["input_ids"]
            return list(ids)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        if isinstance(prompt, str) and self.tokenizer is not None:
            return self.tokenizer(prompt).input_ids
        return None
