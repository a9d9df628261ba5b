"""Batch copies: choosing the native call or a loop, and cutting batches at the descriptor limit.

Pure logic (no device): which path `copy_batch_async` takes for a given runtime, driver and
stream, and how n descriptors split into calls. The calls themselves live in `calls.py`.
"""
from __future__ import annotations

from dataclasses import dataclass

from .vendor import VendorTable


@dataclass(frozen=True, slots=True)
class BatchMode:
    """The batch path a backend instance uses.

    Attributes:
        native: True if `copy_batch_async` is one runtime batch call per chunk.
        max_descriptors: Descriptors per call (the vendor limit when native).
        fail_idx: True if the native call takes a `failIdx` out-argument.
        reason: Why native is off (empty when native), for `capabilities().notes`.
    """

    native: bool
    max_descriptors: int
    fail_idx: bool
    reason: str = ""


#: Descriptors per queued loop chunk when there is no native batch (no vendor limit applies).
LOOP_CHUNK = 1 << 16


def select_batch_mode(table: VendorTable, runtime_version: int, driver_version: int,
                      binding_has_call: bool) -> BatchMode:
    """Pick native batch or per-copy loop from the versions the runtime reports.

    Args:
        table: Vendor table (its `batch.min_runtime`, `fail_idx_below`, `max_descriptors`).
        runtime_version: `*RuntimeGetVersion()` (vendor encoding, e.g. CUDA 12.8 = 12080,
            HIP 7.2 = 70200000).
        driver_version: `*DriverGetVersion()`; 0 if there is no driver. A CUDA driver older
            than the runtime's batch minimum cannot serve the call.
        binding_has_call: The binding (or, with `via_ctypes`, the library) has the batch call.

    Returns:
        The `BatchMode`; a loop mode says why in `reason`.
    """
    quirks = table.batch
    need = table.version_text(quirks.min_runtime)
    if not binding_has_call:
        where = quirks.library if quirks.via_ctypes else table.module
        return BatchMode(False, LOOP_CHUNK, False,
                         f"{table.api('memcpy_batch_async')} not found in {where}; per-copy loop")
    if runtime_version < quirks.min_runtime:
        return BatchMode(False, LOOP_CHUNK, False,
                         f"runtime {table.version_text(runtime_version)} < {need} has no "
                         f"{table.api('memcpy_batch_async')}; per-copy loop")
    if driver_version and driver_version < quirks.min_runtime:
        return BatchMode(False, LOOP_CHUNK, False,
                         f"driver {table.version_text(driver_version)} < {need} has no "
                         f"{table.api('memcpy_batch_async')}; per-copy loop")
    fail_idx = quirks.fail_idx_below is None or runtime_version < quirks.fail_idx_below
    return BatchMode(True, quirks.max_descriptors, fail_idx)


def chunk_bounds(n: int, limit: int) -> list[tuple[int, int]]:
    """Split n descriptors into consecutive [lo, hi) ranges of at most `limit`.

    Raises:
        ValueError: n < 0 or limit < 1.
    """
    if n < 0 or limit < 1:
        raise ValueError(f"chunk_bounds needs n ≥ 0 and limit ≥ 1, got n={n} limit={limit}")
    return [(lo, min(lo + limit, n)) for lo in range(0, n, limit)]


def uses_native(mode: BatchMode, table: VendorTable, stream_handle: int) -> bool:
    """True if a batch on the stream with this raw handle may use the native call.

    The legacy default stream (handle 0) is refused by `cudaMemcpyBatchAsync`, so batches on it
    fall back to the loop (still correct, one call per copy).
    """
    return mode.native and not (table.batch.rejects_legacy_stream and stream_handle == 0)
