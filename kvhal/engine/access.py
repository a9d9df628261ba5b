"""`ManagerHostAccess`: the manager's implementation of `kvhal.tier.HostAccess`.

A tier that asks for it (`SecondaryTier.attach_host`, e.g. p2p serving host slots to peers)
pins and unpins host slots by key from its own threads and hears of every chunk the host tier
gains or loses. Pins are readers on the slot (state > 0), exactly like a load or a cascade:
the manager never evicts, reuses or rewrites a slot with readers, and a chunk discarded while
pinned is freed at the last unpin. Every call holds the manager's lock briefly (the manager
holds it for each of its own calls, so pins and the manager's slot bookkeeping never
interleave).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

from kvhal.host.slots import IDLE
from kvhal.keys import ChunkKey

from .types import EngineError

if TYPE_CHECKING:
    from .manager import Manager


class ManagerHostAccess:
    """`HostAccess` over one manager's slot table (see module docstring).

    Attributes:
        chunk_nbytes: Payload bytes of every chunk.
        slot_bytes: Bytes per slot (`HostAccess.slot_bytes`).

    Raises:
        EngineError: the manager's slots are cut into several pools (a hybrid model's KV cache
            groups have chunks of different sizes, which this access does not describe).
    """

    def __init__(self, manager: "Manager"):
        if len(manager.slots.capacities) > 1:
            raise EngineError(f"host access: {len(manager.slots.capacities)} slot pools (one "
                              "per KV cache group); sharing the host of a hybrid model is not "
                              "supported")
        self._manager = manager
        self.chunk_nbytes = manager.chunk_nbytes
        self.slot_bytes = manager.slot_bytes

    def pin(self, key: ChunkKey) -> int | None:
        """Byte offset of `key`'s slot with one more reader, or None if the key is not
        resident or its slot is being written."""
        m = self._manager
        with m.lock:
            slot = m.slots.index.get(key)
            if slot is None or m.slots.state[slot] < IDLE:
                return None
            m.slots.acquire(slot)
            return slot * m.slot_bytes

    def unpin(self, offset: int) -> None:
        """Remove the reader `pin` added to the slot at `offset`."""
        m = self._manager
        with m.lock:
            m.slots.release(offset // m.slot_bytes)

    def subscribe(self, listener: Callable[[Sequence[ChunkKey], Sequence[ChunkKey]], None]
                  ) -> list[ChunkKey]:
        """Call `listener(gained, lost)` from the manager's calls from now on; returns the
        keys readable now (resident, not being written)."""
        m = self._manager
        with m.lock:
            m.host_listeners.append(listener)
            state = m.slots.state
            return [key for key, slot in m.slots.index.items() if state[slot] >= IDLE]
