"""`kvhal bench vllm-link`: does a tier behind a slow link make TTFT worse than vLLM alone?

At each link of `--links` (default a slow one, 20 Mbit/s, where loading a long prompt's KV
loses to vLLM-CPU's prefill, and a fast one, 10 Gbit/s, where it wins), the whole run happens
inside an emulated link (`integrations/harness/link.py`): a local S3 server (moto) and real
vLLM-CPU engines (the demo model) whose kvhal has the obj tier on that server, all talking
over the namespace's loopback shaped to the link's rate. Two engines in turn, one per
`cost_model`: "always" (every hit loads: kvhal before the cost model) and "model" (the
default). For each of `--samples` prompts of `--context-tokens` tokens, each engine measures:
- alone: vLLM computes the whole prompt (cache-salted, `max_offload_tokens: 0`: nothing is
  found, nothing stored): vLLM alone's TTFT;
- reload: the prompt is computed and stored (it cascades to the obj tier; the run waits
  until the bucket holds its chunks), vLLM's prefix cache and kvhal's host tier are reset,
  and the prompt plus one token is asked again: the obj tier holds it, and kvhal loads it
  or (the model) leaves it to vLLM.
Its output tokens must equal vLLM's at the same reuse boundary (greedy decoding): with no
hit, alone's; with k tokens reused, vLLM's own prefix cache holding the same k tokens (the
first k computed as a prompt of their own, then the prompt asked again, kvhal storing and
finding nothing), whichever way kvhal decided. One table: per link and mode, median TTFTs, reload / alone,
tokens kvhal loaded from the obj tier, outputs identical.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvhal.argtypes import positive_int
from kvhal.report import print_json, print_table

from ..link import EmulatedLink, parse_link, sweep_stale
from ..vllm.model import DEMO
from .links import RUN_TIMEOUT_S
from .tier_obj import bucket_config

MODES = ("always", "model")
#: Tokens generated per request (outputs compared token by token).
MAX_TOKENS = 4
#: The obj tier's `timeout_s`: each attempt of a GET has half of it, and at 4 Mbit/s one chunk
#: of a 1,024-token prompt (1 MiB, 4 loading at a time) takes ~8.4 s, against 10 s at the
#: default 20 s; on a loaded machine half the prompt timed out and "always" loaded 512 of 1,024
#: tokens (seen in CI). A load that times out would measure the timeout, not the link.
LOAD_TIMEOUT_S = 300.0
#: Seconds to wait for a prompt's chunks to reach the bucket.
CASCADE_TIMEOUT_S = 600.0


def _gen(tokens: list[int], salt: str, **extra) -> dict:
    return {"op": "generate", "prompts": {"p": tokens}, "max_tokens": MAX_TOKENS,
            "cache_salt": salt, **extra}


def _wait_objects(tier: dict, at_least: int) -> int:
    """Poll the obj tier's bucket until it holds `at_least` objects (deadline
    `CASCADE_TIMEOUT_S`); returns the count."""
    from kvhal.tiers.obj.client import S3Client
    from kvhal.tiers.obj.config import parse_config
    cfg = parse_config(tier)
    client = S3Client(cfg.store, cfg.timeout_s, 1)
    deadline = time.monotonic() + CASCADE_TIMEOUT_S
    while True:
        count = sum(1 for _ in client.list(cfg.prefix))
        if count >= at_least:
            return count
        if time.monotonic() > deadline:
            raise RuntimeError(f"the bucket holds {count} objects after {CASCADE_TIMEOUT_S} s, "
                               f"expected {at_least}: the cascade did not finish")
        time.sleep(0.2)


def measure_here(context_tokens: int, samples: int, workdir: Path) -> dict:
    """Both engines on this machine's (or namespace's) loopback; every figure in seconds."""
    from ..vllm.runner import EngineProcess

    rng = np.random.default_rng(41)
    prompts = [rng.integers(3, DEMO.vocab_size, context_tokens).tolist() for _ in range(samples)]
    chunks = context_tokens // 128
    out: dict = {}
    objects = 0
    with bucket_config({"type": "obj", "io_threads": 4, "timeout_s": LOAD_TIMEOUT_S}) as tier:
        for mode in MODES:
            config = {"cpu_bytes_to_use": 2 * context_tokens * DEMO.kv_bytes_per_token,
                      "secondary_tiers": [tier], "cost_model": mode}
            num_blocks = 2 * (context_tokens // 128 + 2)
            spec = {"tp": 1, "model": "demo", "num_blocks": num_blocks,
                    "max_model_len": context_tokens + 256, "kvhal": config}
            rows = []
            with EngineProcess(spec, workdir=workdir, name=f"link-{mode}") as engine:
                engine.wait_ready()
                engine.step(_gen(list(range(3, 259)), f"warmup-{mode}"))
                objects = _wait_objects(tier, objects + 2)     # its 2 chunks cascade too
                for i, tokens in enumerate(prompts):
                    alone = engine.step(_gen(tokens + [5], f"alone-{mode}-{i}",
                                             kv_transfer_params={"max_offload_tokens": 0}))
                    engine.step(_gen(tokens, f"{mode}-{i}"))
                    objects = _wait_objects(tier, objects + chunks)
                    engine.step({"op": "reset", "connector": True})
                    reload = engine.step(_gen(tokens + [5], f"{mode}-{i}"))
                    boundary = reload["p"]["num_cached_tokens"]
                    reference = alone
                    if boundary:   # vLLM's own prefix cache holding the same tokens
                        salt = f"reference-{mode}-{i}"
                        engine.step(_gen(tokens[:boundary], salt,
                                         kv_transfer_params={"max_offload_tokens": 0}))
                        reference = engine.step(_gen(tokens + [5], salt, kv_transfer_params={
                            "max_offload_tokens": 0}))
                        if reference["p"]["num_cached_tokens"] != boundary:
                            raise RuntimeError(f"the reference reused "
                                               f"{reference['p']['num_cached_tokens']} tokens, "
                                               f"not the reload's {boundary}")
                    rows.append({"alone_ttft_s": alone["p"]["ttft_s"],
                                 "reload_ttft_s": reload["p"]["ttft_s"],
                                 "obj_hit_tokens": reload["p"]["hit_tokens"].get("obj", 0),
                                 "reuse_boundary": boundary,
                                 "identical": reference["p"]["token_ids"]
                                 == reload["p"]["token_ids"]})
            alone_s = statistics.median(r["alone_ttft_s"] for r in rows)
            reload_s = statistics.median(r["reload_ttft_s"] for r in rows)
            out[mode] = {"alone_ttft_s": alone_s, "reload_ttft_s": reload_s,
                         "reload_vs_alone": reload_s / alone_s,
                         "identical": all(r["identical"] for r in rows), "requests": rows}
    return out


def _inner(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(dir=args.tmp_dir) as tmp:
        print_json(measure_here(args.context_tokens, args.samples, Path(tmp).resolve()))
    return 0


def run(args: argparse.Namespace) -> int:
    """`kvhal bench vllm-link`: the run inside each link, then one table (or JSON); exit 1
    when an output differed from vLLM alone's."""
    from ..vllm.demo import check_vllm

    if args.context_tokens % 128:
        raise ValueError(f"--context-tokens: must be a multiple of 128 (the demo model's block "
                         f"size), got {args.context_tokens}")
    if args.inner:
        return _inner(args)
    check_vllm()
    sweep_stale()
    results = []
    for spec in args.links:
        with EmulatedLink(spec) as link:
            argv = [sys.executable, "-m", "kvhal.cli", "bench", "vllm-link", "--inner",
                    "--context-tokens", str(args.context_tokens), "--samples",
                    str(args.samples), *(["--tmp-dir", args.tmp_dir] if args.tmp_dir else [])]
            done = link.run(argv, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        if done.returncode:
            raise RuntimeError(f"the run at link {spec.label} failed ({done.returncode}): "
                               f"{done.stderr.strip()[-3000:]}")
        results.append({"link": spec.label, "rate_bps": spec.rate_bps,
                        **json.loads(done.stdout)})
    identical = all(r[m]["identical"] for r in results for m in MODES)
    if args.json:
        print_json({"context_tokens": args.context_tokens, "samples": args.samples,
                    "links": results, "identical": identical})
        return 0 if identical else 1
    rows = []
    for r in results:
        for mode in MODES:
            m = r[mode]
            rows.append([r["link"], f"cost_model: {mode}", round(m["alone_ttft_s"], 3),
                         round(m["reload_ttft_s"], 3), round(m["reload_vs_alone"], 2),
                         statistics.median(q["obj_hit_tokens"] for q in m["requests"]),
                         "yes" if m["identical"] else "NO"])
    print_table(f"TTFT of a {args.context_tokens}-token prompt held by the obj tier behind an "
                f"emulated link (vLLM-CPU, demo model, medians of {args.samples})",
                ["link", "kvhal", "vLLM alone s", "reload s", "reload / alone",
                 "tokens loaded from obj", "outputs identical"], rows)
    return 0 if identical else 1


def register(sub: argparse._SubParsersAction) -> None:
    """Add `kvhal bench vllm-link`."""
    p = sub.add_parser("vllm-link", help="TTFT of a prompt reloaded from the obj tier behind "
                       "a slow and a fast emulated link, cost model off and on, vs vLLM alone "
                       "(real vLLM-CPU; needs root)")
    p.add_argument("--links", type=parse_link, nargs="+", default=[parse_link("20mbit"),
                                                                   parse_link("10gbit")],
                   metavar="RATE", help="link rates (default: 20mbit 10gbit)")
    p.add_argument("--context-tokens", type=positive_int, default=2048,
                   help="prompt tokens (a multiple of 128; default 2048)")
    p.add_argument("--samples", type=positive_int, default=2, help="prompts (default 2)")
    p.add_argument("--tmp-dir", default=None, help="folder for the engines' spec files")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    p.set_defaults(func=run)
