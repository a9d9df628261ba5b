"""The device KV pool: accelerator memory a serving engine manages, with its own prefix cache.

It stands in for vLLM's block pool with prefix caching: `num_blocks` device blocks (one block =
one chunk of the trace here); a block freed by a finished request keeps its hash and can be hit
again until it is reused. Free blocks are reused least recently freed first, and a request's
blocks are freed last-chunk-first, so the tail of a prompt is evicted before its shared head
(vLLM `BlockPool.free_blocks` frees a request's blocks in reverse order for the same reason).

Bookkeeping only: the bytes live in a HAL device allocation owned by the replay.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence


class DevicePoolError(ValueError):
    """A request does not fit the device pool; the message names `--device-bytes`."""


class DevicePool:
    """Prefix-caching block pool of `num_blocks` blocks (see module docstring).

    Not thread-safe: the replay drives it from one thread.
    """

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise DevicePoolError("--device-bytes: holds no device block (0 blocks)")
        self.num_blocks = num_blocks
        #: Blocks [_unused, num_blocks) were never handed out; they are older than every freed
        #: block, so they are taken first (kept as a counter: a pool of billions of blocks costs
        #: no memory until used).
        self._unused = 0
        #: Freed blocks, least recently freed first; value = cached hash or None.
        self._free: OrderedDict[int, bytes | None] = OrderedDict()
        self._cached: dict[bytes, int] = {}

    def match_prefix(self, hashes: Sequence[bytes]) -> int:
        """Number of leading `hashes` whose chunks are cached on the device (no side effects)."""
        k = 0
        while k < len(hashes) and hashes[k] in self._cached:
            k += 1
        return k

    def acquire(self, hashes: Sequence[bytes], num_hit: int) -> list[int]:
        """Take blocks for a request: its first `num_hit` cached chunks (from `match_prefix`)
        and fresh blocks for the rest, evicting least recently freed cached blocks.

        Returns:
            Device block ids, one per entry of `hashes`, in order.

        Raises:
            DevicePoolError: the request needs more blocks than the pool has.
        """
        if len(hashes) > self.num_blocks:
            raise DevicePoolError(f"--device-bytes: a request of {len(hashes)} chunks does not "
                                  f"fit a device pool of {self.num_blocks} blocks")
        blocks = [self._cached[h] for h in hashes[:num_hit]]
        for b in blocks:
            del self._free[b]  # requests run one at a time: every cached block is free
        for _ in range(len(hashes) - num_hit):
            if self._unused < self.num_blocks:
                blocks.append(self._unused)
                self._unused += 1
                continue
            b, old = self._free.popitem(last=False)
            if old is not None and self._cached.get(old) == b:
                del self._cached[old]
            blocks.append(b)
        return blocks

    def release(self, hashes: Sequence[bytes], blocks: Sequence[int],
                valid: int) -> None:
        """Free a finished request's blocks; the first `valid` hold their chunk's bytes and stay
        cached under its hash, the rest (failed loads) are freed without a hash. A chunk that is
        already cached in another block (its prefix was evicted, it was not) keeps that one."""
        for i in range(len(blocks) - 1, -1, -1):
            h = hashes[i] if i < valid else None
            if h is not None and self._cached.setdefault(h, blocks[i]) != blocks[i]:
                h = None
            self._free[blocks[i]] = h
