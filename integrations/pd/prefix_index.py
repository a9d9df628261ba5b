"""What prefix of a prompt each instance holds, per tier, from its KV events (fleet routing).

The router keys blocks by its own hash chain over token ids, as llm-d's kv-cache indexer does:
an engine's block hashes depend on its hash seed and algorithm (they differ between
instances), token ids do not. `prefix_keys(tokens)[i]` is the chain's key of `tokens[:i+1]`
(one key per token, `hash((key of the shorter prefix, token))`), so events of any granularity
land on the same keys: vLLM's device events (one block = vLLM's `block_size` tokens), kvhal's
chunk events (contract: one `BlockStored` per chunk, `block_size` = tokens per chunk) and
vLLM's partial-tail events alike. Each event's `block_size` is the unit of that event.

`InstanceIndex.apply` maps one event's engine hashes to chain keys: a `BlockStored` starts from
the key of its `parent_block_hash` (the empty prefix when None; a parent never seen drops the
event, counted in `orphans`, as llm-d's indexer does), walks its `token_ids` and credits the
key at the end of each announced block, that block's full prefix, to the event's tier. Only
announced block ends are credited, never a position inside a block: a router then predicts no
more than the instance can load. An event without token ids (or whose token count is not
`len(block_hashes) * block_size`; or a placeholder: `block_size` 0, no token ids, as kvhal
announces a chunk a tier found without its description, e.g. an object another instance
stored) credits the blocks whose hashes it already knows and counts the rest as orphans. `BlockRemoved` uncredits its known hashes in its tier; `AllBlocksCleared`
empties the instance's index. `ownership` is ignored (kvhal's older events set it to the tier's
label; vLLM leaves it unset except for its kvcr tier).

Tiers (`tier_of`): medium "GPU" or None → "device"; "CPU" → "host"; "STORAGE" → "disk";
either of the last two is "shared" when its `locality` is "REMOTE" (a fleet-shared tier: obj
publishes STORAGE/REMOTE, mooncake's pool CPU/REMOTE). A block held
in several tiers counts once, in the fastest (`InstanceIndex.held`).

A prompt's first block's extra keys (vLLM's `extra_keys[0]` of an event whose parent is None:
the cache salt, as `(salt,)` when the request has no LoRA nor multimodal input) start its
chain at `root_key(extra)` instead of `ROOT`, so a salted prompt and an unsalted one with the
same tokens never share keys (the request's side: `root_key((cache_salt,))`). Not keyed: the
extra keys of later blocks (multimodal) and LoRA names beyond the first block's extra keys. A
request whose blocks hash apart for those reasons is predicted to hit when it will not: that
costs one miss, never a wrong answer (the engine decides what it reuses by its own hashes).
Not thread-safe: the router calls it from its one event loop.
"""
from __future__ import annotations

import json
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

#: Tiers in the order a request's prefix is loaded from them (fastest first).
TIERS = ("device", "host", "disk", "shared")
#: Chain key of the empty prefix.
ROOT = 0
#: Engine hashes an instance's index remembers (oldest forgotten first): ~200 MB at most.
MAX_HASHES = 1 << 20


class EventError(ValueError):
    """An event the index cannot apply (wrong types or shapes); the message names the field."""


def tier_of(medium: str | None, locality: str | None) -> str:
    """The router's tier of an event's `medium` and `locality` (module docstring).

    Raises:
        EventError: an unknown medium (names it).
    """
    if medium is None or medium == "GPU":
        return "device"
    if medium in ("CPU", "STORAGE"):
        if locality == "REMOTE":
            return "shared"
        return "host" if medium == "CPU" else "disk"
    raise EventError(f"medium: unknown {medium!r} (expected GPU, CPU, STORAGE or null)")


def root_key(extra: Sequence[Any] | None) -> int:
    """The chain's start for a prompt whose first block has vLLM extra keys `extra` (e.g.
    `(cache_salt,)`); `ROOT` when None or empty."""
    if not extra:
        return ROOT
    return hash(("extra", json.dumps(list(extra), default=str)))


def prefix_keys(tokens: Sequence[int], root: int = ROOT) -> list[int]:
    """Chain keys of every prefix of `tokens` from `root` (`root_key`): element i is the key
    of `tokens[:i+1]`."""
    keys, key = [], root
    for token in tokens:
        key = hash((key, token))
        keys.append(key)
    return keys


@dataclass(slots=True)
class InstanceIndex:
    """One instance's blocks per tier, keyed by chain key (see the module docstring).

    Attributes:
        blocks: Engine block hash → (chain key, prefix length in tokens) of every block seen,
            at most `max_hashes` (oldest forgotten first).
        held: Per tier, chain key → prefix length of the blocks the instance holds there.
        orphans: Blocks dropped: parent never seen, or no token ids for an unknown hash.
        min_block_tokens: The smallest device `block_size` seen (vLLM's block size), or None.
        longest: Tokens of the longest prefix credited since the last `clear` (an upper
            bound of what `prefix` can find: a router hashes no prompt token beyond it).
    """

    max_hashes: int = MAX_HASHES
    blocks: dict[Hashable, tuple[int, int]] = field(default_factory=dict)
    held: dict[str, dict[int, int]] = field(default_factory=lambda: {t: {} for t in TIERS})
    orphans: int = 0
    min_block_tokens: int | None = None
    longest: int = 0

    def clear(self) -> None:
        """Forget everything the instance held (its engine-hash map too)."""
        self.blocks.clear()
        for keys in self.held.values():
            keys.clear()
        self.longest = 0

    def counts(self) -> dict[str, int]:
        """Blocks held per tier."""
        return {tier: len(keys) for tier, keys in self.held.items()}

    def apply(self, event: Any) -> None:
        """Apply one decoded event (`events_sub`'s `BlockStored`, `BlockRemoved` or
        `AllBlocksCleared`, or vLLM's own classes: same field names).

        Raises:
            EventError: a field of the wrong type or shape, or an unknown medium; the index
                is unchanged by a `BlockStored`/`BlockRemoved` that raises.
        """
        kind = type(event).__name__
        if kind == "AllBlocksCleared":
            self.clear()
            return
        hashes = event.block_hashes
        if not isinstance(hashes, list) or not all(isinstance(h, (bytes, int))
                                                    for h in hashes):
            raise EventError(f"{kind}.block_hashes: must be a list of bytes or ints")
        tier = tier_of(event.medium, event.locality)
        if kind == "BlockRemoved":
            held = self.held[tier]
            for h in hashes:
                known = self.blocks.get(h)
                if known is not None:
                    held.pop(known[0], None)
            return
        if kind != "BlockStored":
            raise EventError(f"event type: unknown {kind!r}")
        self._stored(event, hashes, tier)

    def _stored(self, event: Any, hashes: list, tier: str) -> None:
        size, tokens = event.block_size, event.token_ids
        placeholder = size == 0 and tokens == []      # vLLM's and kvhal's hash-only form
        if not isinstance(size, int) or (size <= 0 and not placeholder):
            raise EventError(f"BlockStored.block_size: must be a positive integer, got "
                             f"{size!r}")
        if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise EventError("BlockStored.token_ids: must be a list of ints")
        parent = event.parent_block_hash
        if parent is not None and not isinstance(parent, (bytes, int)):
            raise EventError(f"BlockStored.parent_block_hash: must be bytes, an int or null, "
                             f"got {type(parent).__name__}")
        held = self.held[tier]
        if placeholder or len(tokens) != len(hashes) * size:   # no usable token ids: known
            # hashes only
            for h in hashes:
                known = self.blocks.get(h)
                if known is None:
                    self.orphans += 1
                else:
                    held[known[0]] = known[1]
                    self.longest = max(self.longest, known[1])
            return
        if parent is None:
            extra = event.extra_keys
            start = (root_key(extra[0] if isinstance(extra, list) and extra else None), 0)
        else:
            start = self.blocks.get(parent)
        if start is None:
            self.orphans += len(hashes)
            return
        if tier == "device" and (self.min_block_tokens is None or size < self.min_block_tokens):
            self.min_block_tokens = size
        key, length = start
        for i, h in enumerate(hashes):
            for token in tokens[i * size:(i + 1) * size]:
                key = hash((key, token))
            length += size
            self._remember(h, key, length)
            held[key] = length
        self.longest = max(self.longest, length)

    def _remember(self, block_hash: Hashable, key: int, length: int) -> None:
        self.blocks.pop(block_hash, None)
        self.blocks[block_hash] = (key, length)
        if len(self.blocks) > self.max_hashes:
            del self.blocks[next(iter(self.blocks))]

    def prefix(self, keys: Sequence[int], tier: str) -> int:
        """Tokens of the longest prefix (of the prompt whose `prefix_keys` are `keys`) the
        instance holds in `tier`; 0 if none."""
        held = self.held[tier]
        if not held:
            return 0
        for n in range(len(keys), 0, -1):
            if keys[n - 1] in held:
                return n
        return 0

    def hits(self, keys: Sequence[int]) -> dict[str, int]:
        """Tokens of the prompt each tier adds, loading from the fastest first: tier t gets
        the tokens of its longest held prefix beyond those of the faster tiers."""
        out, covered = {}, 0
        for tier in TIERS:
            n = self.prefix(keys, tier)
            out[tier] = max(0, n - covered)
            covered = max(covered, n)
        return out
