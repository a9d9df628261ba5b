"""A poisoning `KVHalConnector`: kvhal's connector plus a proof that no store reads a reused
block.

Test-only (loaded by `kv_connector_module_path: "poison"` from `engine_run.py`'s folder; vLLM
looks the connector up by its `kv_connector` name in that module, so the class here carries
the production connector's name).
Every block vLLM's block pool hands out (`BlockPool.get_new_blocks`) is overwritten with the
byte `POISON` in every layer on the worker, at the start of the step that first uses it: right
after kvhal's `handle_preemptions` returns (vLLM's promise: blocks are not overwritten before
it; vLLM calls it first in `execute_model`), before this step's loads and forward write real KV
into it. (`start_load_kv` would be too late: without sync loads vLLM calls it after the
forward.) A store that read a
block after vLLM handed it out again would copy poison into its host slot; every finished
store's slots are scanned for poison rows the moment the scheduler learns it finished.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvhal.integrations.vllm import connector

POISON = 0xA5
#: A row of this many POISON bytes never occurs in real KV (random-weight model activations).
ROW_BYTES = 64


def poisoned_rows(buf: np.ndarray) -> int:
    """Number of aligned `ROW_BYTES` rows of `buf` (uint8) that are all POISON."""
    rows = buf[:buf.size // ROW_BYTES * ROW_BYTES].reshape(-1, ROW_BYTES)
    return int((rows == POISON).all(axis=1).sum())


class KVHalConnector(connector.KVHalConnector):
    """kvhal's connector that poisons handed-out blocks and checks stores (module docstring).

    Attributes (scheduler role): handed_out (blocks handed out), reused (of them, blocks handed
    out before), checked_chunks (stored chunks scanned), poisoned_chunks (of them, with poison).
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._pending: list[int] = []
        self._seen: set[int] = set()
        self._store_slots: dict[int, np.ndarray] = {}
        self._kv: list[torch.Tensor] = []
        self.handed_out = self.reused = self.checked_chunks = self.poisoned_chunks = 0

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        pool = kv_cache_manager.block_pool
        original = pool.get_new_blocks

        def get_new_blocks(num_blocks: int):
            blocks = original(num_blocks)
            ids = [b.block_id for b in blocks]
            self.handed_out += len(ids)
            self.reused += sum(i in self._seen for i in ids)
            self._seen.update(ids)
            self._pending += ids
            return blocks

        pool.get_new_blocks = get_new_blocks

    def build_connector_meta(self, scheduler_output: Any):
        meta = super().build_connector_meta(scheduler_output)
        meta.poison = np.asarray(self._pending, dtype=np.int64)
        self._pending = []
        self._store_slots.update((job.job_id, job.slots) for job in meta.stores)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        worker_meta = connector_output.kv_connector_worker_meta
        side = self.scheduler_side
        for job_id, num_ok in (worker_meta.num_ok.items() if worker_meta else ()):
            slots = self._store_slots.pop(job_id, None)
            for slot in (slots[:num_ok] if slots is not None else ()):
                offset, nbytes = side.layout.slot_span(int(slot))
                payload = side.region.array[offset:offset + nbytes]
                self.checked_chunks += 1
                self.poisoned_chunks += poisoned_rows(payload) > 0

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        self._kv = list(kv_caches.values())

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        super().handle_preemptions(kv_connector_metadata)
        ids = torch.from_numpy(kv_connector_metadata.poison)
        if len(ids):
            for tensor in self._kv:
                tensor.view(torch.uint8)[ids] = POISON
