"""The soak's `tp2_sigterm` fault: a clean SIGTERM shutdown of a TP=2 kvhal server must land the
stores it has in flight.

At TP=2, vLLM-CPU's engine core shuts its executor down before its scheduler and its workers
ignore the request to exit, so kvhal's drain at the scheduler's shutdown came too late and
stores in flight were lost (fixed by keeping vLLM's busy loop stepping while a
store is in flight and closing the tiers as it ends: `integrations/vllm/lifetime.py`,
`tests/vllm/test_shutdown_drain.py`). Under the soak it runs beside the fleet's load and
faults: a third kvhal server at `--tensor-parallel-size 2` with its own fs folder (so the
fleet's evictions cannot take its chunks before they are counted) and `SHUTDOWN_S` to drain
(vLLM finishes the requests it runs, then stops) is started and asked one prompt of `CHUNKS`
chunks; it gets SIGTERM as soon as the first chunk file of that prompt is on its disk, in the
middle of the prefill and of the cascade to its fs tier. vLLM answers the request; once its
processes are gone every chunk must be on its disk, with no temp file. A TP=2 engine on this
2-core machine shares the fleet's cores, so the fault runs on a thread of its own (the
schedule goes on).
"""
from __future__ import annotations

import glob
import signal
import threading
import time
from pathlib import Path

import numpy as np
import psutil

from . import fleet
from .load import complete

#: Full chunks (128 tokens each) of the prompt the TP=2 server prefills at its SIGTERM.
CHUNKS = 100
#: Seconds the TP=2 server may take to start beside the fleet, and to drain and exit after
#: SIGTERM (its `--shutdown-timeout`); seconds its answer may take.
START_S, SHUTDOWN_S, ANSWER_S = 600.0, 300.0, 600.0


def _chunk_files(root: Path) -> tuple[int, int]:
    """(chunk files, temp files) of the fs tier under `root`."""
    return (len(glob.glob(str(root / "*" / "chunks" / "*" / "*.kv"))),
            len(glob.glob(str(root / "**" / "*.tmp"), recursive=True)))


def sigterm_at_tp2(model: Path, workdir: Path, seed: int, n: int, vocab_size: int) -> dict:
    """Start TP=2 server number `n` (its own fs folder under `workdir`), send it one prompt of
    `CHUNKS` chunks (seeded by `seed` and `n`), SIGTERM its API server once the first chunk
    file is on disk, wait for the answer and for its processes to exit, and count its chunk
    files.

    Returns:
        {"chunks": CHUNKS, "on_disk_at_sigterm", "on_disk", "temp_files", "answered" (the
        request was answered: vLLM drained it), "exit_s", "left" (pids still running after
        `SHUTDOWN_S`, then killed), "error" (None, or why the server did not start or
        answer), "lost" (chunks not on disk after the exit)}.
    """
    root = workdir / f"tp2-{n}" / "kv"
    root.mkdir(parents=True, exist_ok=True)
    chunk_bytes = fleet.HOST_BYTES // 48
    config = {"cpu_bytes_to_use": 2 * CHUNKS * chunk_bytes,
              "secondary_tiers": [{"type": "fs", "root_dir": str(root)}]}
    tokens = CHUNKS * 128
    server = fleet.Server(f"tp2-{n}", model, workdir, config, tp=2, events=False,
                          max_model_len=tokens + 128, num_blocks=tokens // 128 + 8,
                          shutdown_s=SHUTDOWN_S)
    out: dict = {"chunks": CHUNKS, "error": None, "answered": False}
    try:
        server.start(wait=False)
        server.proc.timeout_s = START_S
        server.proc.wait_ready()
        prompt = np.random.default_rng([seed, n]).integers(3, vocab_size, tokens).tolist()
        asked = threading.Thread(target=_ask, args=(server.url, str(model), prompt, out),
                                 name="soak-tp2-ask", daemon=True)
        asked.start()
        deadline = time.monotonic() + ANSWER_S
        while _chunk_files(root)[0] == 0 and asked.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        procs = server.processes()
        t = time.monotonic()
        server.proc.api_server().send_signal(signal.SIGTERM)
        out["on_disk_at_sigterm"] = _chunk_files(root)[0]
        asked.join(ANSWER_S)
        _, left = psutil.wait_procs(procs, timeout=SHUTDOWN_S + 60)
        out["exit_s"] = round(time.monotonic() - t, 2)
        out["left"] = [p.pid for p in left]
    except Exception as e:  # noqa: BLE001 - the fault's outcome, reported
        out["error"] = f"{type(e).__name__}: {e}"[:300]
    finally:
        server.kill()
    out["on_disk"], out["temp_files"] = _chunk_files(root)
    out["lost"] = 0 if out["error"] else CHUNKS - out["on_disk"]
    return out


def _ask(url: str, model: str, prompt: list[int], out: dict) -> None:
    try:
        out["answered"] = bool(complete(url, model, prompt, "tp2", 1)["choices"])
    except Exception as e:  # noqa: BLE001 - reported with the fault
        out["answer_error"] = f"{type(e).__name__}: {e}"[:300]


def describe(result: dict) -> str:
    """One line of a `sigterm_at_tp2` result for the fault list."""
    if result["error"]:
        return f"TP=2 server: {result['error']}"
    return (f"TP=2 server SIGTERMed mid-prefill: {result['on_disk_at_sigterm']} of "
            f"{result['chunks']} chunks on disk at the signal, {result['on_disk']} after its "
            f"exit ({result['exit_s']} s; answered: {result['answered']}), "
            f"{result['temp_files']} temp files")

