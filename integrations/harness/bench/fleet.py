"""`kvhal bench fleet`: N vLLM-CPU OpenAI servers with kvhal behind `kvhal proxy`, one router
policy at a time, side by side in one run.

Each contender is a router policy of `kvhal proxy --route` (`ROUTERS`): round-robin, session
affinity, kvhal's KV-aware and load-aware router, and the same plus p2p load balancing. For
each, the bench starts `--instances` fresh servers (demo model, `--num-blocks` device blocks
each; kvhal with a host tier, an fs tier in a fresh folder and a p2p tier, KV events published
on an endpoint of its own) and the proxy as a subprocess in front of them, runs the points,
and stops them all: no contender inherits another's KV. Each instance computes on a core of
its own where there are enough (`VLLM_CPU_OMP_THREADS_BIND`).

Points (`chat.run_chats` through the proxy; conversations named after the point, so no point
reuses another's KV):
- `multi-turn`: `--conversations` conversations of `--turns` turns; their KV is more than one
  instance's device cache, and each instance's tiers hold about its share of it (the working
  set / N), not all of it: a router that spreads a conversation over every instance makes each
  instance hold every conversation.
- `hot-prefix`: `--hot-sessions` sessions whose first prompt starts with the same
  `--hot-prefix-tokens` system prompt, sent alone once before the point (`prime`), so one
  instance holds it when the sessions arrive: every KV-aware choice points at that instance,
  and load balancing (`kv-p2p`) has the others pull it over p2p.

Per router and point: requests/s, TTFT and end-to-end p50/p90, prompt tokens by source summed
over the servers' `/metrics` (`vllm:prompt_tokens_cached_by_source`: device, host, disk, p2p)
and per server, and the router's own counts (`GET /router/stats`, delta over the point).

Correctness: a single vLLM server whose KV cache keeps every conversation (`reference`; vLLM's
prefix cache reuses whole 128-token blocks, as kvhal's `blocks_per_chunk: 1` chunks do) runs
the same points one request at a time; every contender's answers are compared with its answers
token for token where the prompts are equal (`serving.compare`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvhal.argtypes import names_from, positive_int
from kvhal.report import print_table, progress

from ..vllm.chat import ChatShape
from ..vllm.server import kv_events_config
from .serving import (
    add_run_args,
    compare,
    error_line,
    ms,
    print_correctness,
    reference_blocks,
    run_point,
    server_env,
    start_run,
    warmup,
    warmup_body,
    write_report,
)

ROUTERS = ("round-robin", "affinity", "kv", "kv-p2p")
LABELS = {"round-robin": "round-robin", "affinity": "session affinity",
          "kv": "KV-aware", "kv-p2p": "KV-aware + p2p load balancing",
          "reference": "one server, KV cache keeps everything, one request at a time"}
POINTS = ("multi-turn", "hot-prefix")
#: What each target compares, as (name, what it says, met when).
TARGETS = (
    ("kv_over_round_robin_requests_per_s", "multi-turn: KV-aware req/s >= 1.5x round-robin's",
     lambda r: r >= 1.5),
    ("kv_over_round_robin_ttft_p90", "multi-turn: KV-aware p90 TTFT <= 1/3 of round-robin's",
     lambda r: r <= 1 / 3),
    ("kv_p2p_over_kv_ttft_p90", "hot prefix: KV-aware + p2p p90 TTFT < KV-aware's",
     lambda r: r < 1),
)
#: Seconds `prime` waits for the router to index the primed prefix.
PRIME_WAIT_S = 10.0
#: Seconds one `/router/stats` request may take.
STATS_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Instance:
    """One server of a contender's fleet: its ports and its kvhal tiers.

    Attributes:
        port: Its OpenAI server's port (127.0.0.1).
        events_port: Where vLLM's ZMQ publisher of its KV events binds.
        replay_port: Where vLLM's ZMQ replay socket of its KV events binds.
        p2p_port: Where its kvhal p2p tier listens.
        fs_root: Its fs tier's folder (fresh per contender).
        core: The core its model worker computes on, or None to leave vLLM's choice.
    """

    port: int
    events_port: int
    replay_port: int
    p2p_port: int
    fs_root: Path
    core: int | None

    @property
    def base_url(self) -> str:
        """Its OpenAI server, "http://127.0.0.1:PORT"."""
        return f"http://127.0.0.1:{self.port}"

    def spec(self) -> str:
        """Its `kvhal proxy --instance` SPEC: URL, events and replay endpoints, p2p address."""
        return (f"{self.base_url},events=tcp://127.0.0.1:{self.events_port},"
                f"replay=tcp://127.0.0.1:{self.replay_port},p2p=127.0.0.1:{self.p2p_port}")

    def kv_transfer_config(self, host_bytes: int, fs_bytes: int, key_file: Path) -> dict:
        """vLLM's `kv_transfer_config`: kvhal with a host tier, an fs tier and a p2p tier
        without `peers` (it pulls only what a request's `remote_kv_source` names)."""
        return {"kv_connector": "KVHalConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "cpu_bytes_to_use": host_bytes, "blocks_per_chunk": 1,
                    "secondary_tiers": [
                        {"type": "fs", "root_dir": str(self.fs_root), "max_bytes": fs_bytes},
                        {"type": "p2p", "host": "127.0.0.1", "port": self.p2p_port,
                         "auth_key_file": str(key_file)}]}}

    def kv_events_config(self) -> dict:
        """vLLM's `kv_events_config` at its ports (`server.kv_events_config`)."""
        return kv_events_config(self.events_port, self.replay_port)


#: `--routers`: "round-robin,kv" as a list of `ROUTERS` names, in `ROUTERS` order.
parse_routers = names_from(ROUTERS, "router")


def numeric_delta(before: Any, after: Any) -> Any:
    """`after - before` for every number of `after`, recursively through dicts (a key absent
    before counts from 0) and lists (by index); anything else is `after`'s value. For
    `/router/stats`, whose counters only grow."""
    if isinstance(after, dict):
        before = before if isinstance(before, dict) else {}
        return {k: numeric_delta(before.get(k), v) for k, v in after.items()}
    if isinstance(after, list):
        before = before if isinstance(before, list) else []
        return [numeric_delta(before[i] if i < len(before) else None, v)
                for i, v in enumerate(after)]
    if isinstance(after, (int, float)) and not isinstance(after, bool):
        prior = before if isinstance(before, (int, float)) and not isinstance(before, bool) \
            else 0
        return after - prior
    return after


def flatten_numbers(tree: Any, prefix: str = "") -> dict[str, float]:
    """The numbers of a JSON tree by dotted path ("instances.0.routed": 12); lists count as
    dicts keyed by index."""
    if isinstance(tree, list):
        tree = dict(enumerate(tree))
    if isinstance(tree, dict):
        out: dict[str, float] = {}
        for k, v in tree.items():
            out |= flatten_numbers(v, f"{prefix}{k}.")
        return out
    if isinstance(tree, (int, float)) and not isinstance(tree, bool):
        return {prefix.rstrip("."): tree}
    return {}


def ratios(points: dict[str, list[dict]]) -> dict[str, float | None]:
    """The targets' ratios (`TARGETS` names) from the routers' points (`POINTS` order); None
    where a router did not run or a figure is missing or zero."""
    def get(router: str, point: str, fig) -> float | None:
        runs = points.get(router)
        return None if not runs else fig(runs[POINTS.index(point)])

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else a / b

    rps = lambda p: p["requests_per_s"]
    p90 = lambda p: p["ttft_s"]["p90"] 
    return {
        "kv_over_round_robin_requests_per_s": ratio(get("kv", "multi-turn", rps),
                                                    get("round-robin", "multi-turn", rps)),
        "kv_over_round_robin_ttft_p90": ratio(get("kv", "multi-turn", p90),
                                              get("round-robin", "multi-turn", p90)),
        "kv_p2p_over_kv_ttft_p90": ratio(get("kv-p2p", "hot-prefix", p90),
                                         get("kv", "hot-prefix", p90)),
    }


def targets(measured: dict[str, float | None]) -> list[dict]:
    """Each of `TARGETS` with its measured ratio and whether it is met (None: not measured)."""
    return [{"name": name, "target": text, "ratio": measured[name],
             "met": None if measured[name] is None else bool(met(measured[name]))}
            for name, text, met in TARGETS]


def shapes(args: argparse.Namespace) -> dict[str, ChatShape]:
    """The points' workloads (`POINTS` order) from the command's flags."""
    return {
        "multi-turn": ChatShape(args.conversations, args.turns, args.initial_tokens,
                                args.turn_tokens, args.answer_tokens, args.concurrency,
                                args.seed),
        "hot-prefix": ChatShape(args.hot_sessions, args.hot_turns, args.hot_tokens,
                                args.hot_tokens, args.answer_tokens, args.hot_concurrency,
                                args.seed, shared_prefix_tokens=args.hot_prefix_tokens),
    }


def router_stats(proxy_url: str) -> dict[str, Any]:
    """The proxy's `GET /router/stats` JSON, or {"error": why} when it does not answer one."""
    try:
        with urllib.request.urlopen(f"{proxy_url}/router/stats",
                                    timeout=STATS_TIMEOUT_S) as resp:
            return json.loads(resp.read())
    except (OSError, urllib.error.URLError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def _indexed_blocks(stats: dict) -> int:
    instances = stats.get("instances")
    if not isinstance(instances, list):
        return 0
    return sum(sum(flatten_numbers(i.get("index_blocks", {})).values()) for i in instances
               if isinstance(i, dict))


def prime(base_url: str, model: str, shape: ChatShape, *, kvhal: bool,
          stats_url: str | None) -> None:
    """Send the shared prefix alone (one request, one token) before the point, so that one
    instance holds it when the sessions arrive, as a hot system prompt is held where it was
    first served; then, behind a router, wait until its `/router/stats` index grew (its
    `index_blocks`; at most `PRIME_WAIT_S`, not at all where the answer has no such counts).

    Raises:
        RuntimeError: the request was not answered 200.
    """
    from ..vllm.chat import shared_prefix
    from ..vllm.model import DEMO

    before = 0 if stats_url is None else _indexed_blocks(router_stats(stats_url))
    body = {"model": model, "prompt": shared_prefix(shape, DEMO.vocab_size), "max_tokens": 1,
            "temperature": 0, **({"kv_transfer_params": {}} if kvhal else {})}
    asyncio.run(warmup(base_url, body))
    deadline = time.monotonic() + PRIME_WAIT_S
    while stats_url is not None and time.monotonic() < deadline:
        if _indexed_blocks(router_stats(stats_url)) > before:
            break
        time.sleep(0.1)


def _run_points(base_url: str, model_dir: Path, shapes_: dict[str, ChatShape], *,
                metrics_urls: list[str], kvhal: bool, timeout_s: float, name: str, bar,
                task, stats_url: str | None) -> list[dict]:
    from ..vllm.model import DEMO

    points = []
    for point, shape in shapes_.items():
        total = shape.conversations * shape.turns
        desc = f"{name}: {point}, {shape.conversations} conversations"
        bar.update(task, description=desc, total=total, completed=0)

        def report_progress(n_done: int, sample: dict, desc=desc) -> None:
            bar.update(task, completed=n_done, description=(
                f"{desc} (running {sample['running']:.0f}, waiting "
                f"{sample['waiting']:.0f}, {sample['t_s']:.0f} s)"))

        if shape.shared_prefix_tokens:
            bar.update(task, description=f"{desc}: priming the shared prefix")
            prime(base_url, str(model_dir), shape, kvhal=kvhal, stats_url=stats_url)
        before = None if stats_url is None else router_stats(stats_url)
        figures = asyncio.run(run_point(
            base_url, str(model_dir), shape, vocab_size=DEMO.vocab_size,
            name_prefix=f"{point}-c", timeout_s=timeout_s,
            extra_body={"kv_transfer_params": {}} if kvhal else None,
            report_progress=report_progress, metrics_urls=metrics_urls))
        figures = {"point": point, **figures}
        if stats_url is not None:
            after = router_stats(stats_url)
            figures["router_stats"] = numeric_delta(before, after)
            figures["router_stats_after"] = after
        bar.update(task, description=desc, completed=figures["requests"])
        points.append(figures)
    return points


def run_router(router: str, shapes_: dict[str, ChatShape], args: argparse.Namespace, *,
               model_dir: Path, workdir: Path, max_model_len: int, key_file: Path, bar
               ) -> dict[str, Any]:
    """Start `args.instances` fresh servers and `kvhal proxy --route router` in front of
    them, run every point through the proxy, stop them all; return {"points": [...],
    "worker_cores": [...] per instance, "instances": [SPEC ...]}.

    Raises:
        server.ServerDidNotStart: a server or the proxy did not come up (names its log).
    """
    from ..vllm.server import ServerProcess, free_port, server_argv

    cores = sorted(os.sched_getaffinity(0))
    folder = workdir / router
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    instances = [Instance(free_port(), free_port(), free_port(), free_port(),
                          folder / f"fs-{i}", cores[i % len(cores)]
                          if len(cores) >= args.instances else None)
                 for i in range(args.instances)]
    task = bar.add_task(f"{router}: starting {args.instances} vLLM servers", total=None)
    extra = () if args.max_num_seqs is None else ("--max-num-seqs", str(args.max_num_seqs))
    with ExitStack() as stack:
        servers = []
        for i, inst in enumerate(instances):
            inst.fs_root.mkdir()
            argv = server_argv(
                model_dir, inst.port, num_blocks=args.num_blocks, max_model_len=max_model_len,
                kv_transfer_config=inst.kv_transfer_config(args.host_mib << 20,
                                                            args.fs_mib << 20, key_file),
                extra=(*extra, "--kv-events-config", json.dumps(inst.kv_events_config())))
            servers.append(stack.enter_context(ServerProcess(
                argv, inst.port, folder / f"server-{i}.log",
                server_env(args.num_blocks, inst.core))))
        for server in servers:
            server.wait_ready()
        for server in servers:
            asyncio.run(warmup(server.base_url, warmup_body(
                str(model_dir), shapes_["multi-turn"].initial_tokens, kvhal=True)))
        bar.update(task, description=f"{router}: starting kvhal proxy")
        proxy_port = free_port()
        proxy_argv = [sys.executable, "-m", "kvhal.cli", "proxy", "--route", router,
                      "--host", "127.0.0.1", "--port", str(proxy_port)]
        for inst in instances:
            proxy_argv += ["--instance", inst.spec()]
        proxy = stack.enter_context(ServerProcess(proxy_argv, proxy_port,
                                                  folder / "proxy.log", timeout_s=60))
        proxy.wait_ready()
        points = _run_points(proxy.base_url, model_dir, shapes_,
                             metrics_urls=[s.base_url for s in servers], kvhal=True,
                             timeout_s=args.request_timeout_s, name=router, bar=bar,
                             task=task, stats_url=proxy.base_url)
        worker_cores = [s.worker_cores() for s in servers]
    bar.remove_task(task)
    return {"points": points, "worker_cores": worker_cores,
            "instances": [inst.spec() for inst in instances]}


def run_reference(shapes_: dict[str, ChatShape], args: argparse.Namespace, *,
                  model_dir: Path, workdir: Path, max_model_len: int, bar) -> dict[str, Any]:
    """One vLLM server (no connector) whose KV cache keeps every conversation of the largest
    point, running every point one request at a time (`--max-num-seqs 1`, concurrency 1).

    Raises:
        server.ServerDidNotStart: the server did not come up (names its log).
    """
    from ..vllm.server import ServerProcess, free_port, server_argv

    serial = {p: replace(s, concurrency=1) for p, s in shapes_.items()}
    num_blocks = max(args.num_blocks, *(reference_blocks(s) for s in serial.values()))
    port = free_port()
    core = min(os.sched_getaffinity(0))
    task = bar.add_task("reference: starting vLLM's OpenAI server", total=None)
    argv = server_argv(model_dir, port, num_blocks=num_blocks, max_model_len=max_model_len,
                       extra=("--max-num-seqs", "1"))
    with ServerProcess(argv, port, workdir / "server-reference.log",
                       server_env(num_blocks, core)) as server:
        server.wait_ready()
        asyncio.run(warmup(server.base_url, warmup_body(
            str(model_dir), shapes_["multi-turn"].initial_tokens, kvhal=False)))
        points = _run_points(server.base_url, model_dir, serial,
                             metrics_urls=[server.base_url], kvhal=False,
                             timeout_s=args.request_timeout_s, name="reference", bar=bar,
                             task=task, stats_url=None)
        cores = [server.worker_cores()]
    bar.remove_task(task)
    return {"points": points, "worker_cores": cores, "num_blocks": num_blocks}


def run(args: argparse.Namespace) -> int:
    """`kvhal bench fleet`: run the reference and every router, print the table (or JSON);
    exit 0 when every router ran and every request was answered."""
    import secrets

    from ..vllm.model import DEMO, build_model
    from ..vllm.server import ServerDidNotStart

    shapes_ = shapes(args)
    longest = max(s.longest_prompt() + s.answer_tokens for s in shapes_.values())
    workdir, max_model_len = start_run(args, longest, "a prompt and its answer need up to")
    key_file = workdir / "p2p.key"
    key_file.write_text(secrets.token_urlsafe(24))
    key_file.chmod(0o600)
    model_dir = build_model(DEMO)
    report: dict[str, Any] = {
        "workload": {
            "instances": args.instances, "num_blocks": args.num_blocks,
            "host_bytes": args.host_mib << 20, "fs_bytes": args.fs_mib << 20,
            "max_num_seqs": args.max_num_seqs, "model": DEMO.name,
            "kv_bytes_per_token": DEMO.kv_bytes_per_token,
            "points": {p: {"conversations": s.conversations, "turns": s.turns,
                           "initial_tokens": s.initial_tokens, "turn_tokens": s.turn_tokens,
                           "answer_tokens": s.answer_tokens, "concurrency": s.concurrency,
                           "shared_prefix_tokens": s.shared_prefix_tokens,
                           "longest_prompt": s.longest_prompt()}
                       for p, s in shapes_.items()}},
        "routers": {}, "points": {}, "not_run": {}}
    start = time.perf_counter()
    with progress(disable=args.json) as bar:
        ref = run_reference(shapes_, args, model_dir=model_dir, workdir=workdir,
                            max_model_len=max_model_len, bar=bar)
        report["points"]["reference"] = ref.pop("points")
        report["routers"]["reference"] = {"label": LABELS["reference"], **ref}
        for router in args.routers:
            try:
                got = run_router(router, shapes_, args, model_dir=model_dir, workdir=workdir,
                                 max_model_len=max_model_len, key_file=key_file, bar=bar)
            except ServerDidNotStart as exc:
                report["not_run"][router] = f"{exc.log}: " + error_line(
                    exc.log.read_text() if exc.log.exists() else str(exc))
                continue
            report["points"][router] = got.pop("points")
            report["routers"][router] = {"label": LABELS[router], **got}
    report["correctness"] = compare(report["points"])
    report["ratios"] = ratios(report["points"])
    report["targets"] = targets(report["ratios"])
    report["wall_s"] = time.perf_counter() - start
    write_report(report, args, workdir, plot, print_report)
    unanswered = sum(p["answered"] != p["requests"] + p["not_sent"]
                     for points in report["points"].values() for p in points)
    return 1 if unanswered or report["not_run"] else 0


def _nonzero(counts: dict) -> str:
    return " ".join(f"{k} {v:g}" for k, v in flatten_numbers(counts).items() if v)


def stats_line(stats: dict | None) -> str:
    """A `/router/stats` delta in one line: per instance, requests routed by reason and the
    prompt tokens the router predicted each tier would serve (the contract's keys), or every
    number that changed where the answer has no `instances` list."""
    instances = (stats or {}).get("instances")
    if not isinstance(instances, list):
        return _nonzero(stats or {}) or "(nothing counted)"
    return "; ".join(
        f"instance {i}: routed {inst.get('routed', 0):g} ({_nonzero(inst.get('by_reason', {}))})"
        f", predicted hits ({_nonzero(inst.get('predicted_hit_tokens', {})) or 'none'})"
        for i, inst in enumerate(instances))


def print_report(report: dict, workdir: Path) -> None:
    """The per-router, per-point table, router counts, ratios and targets, correctness,
    cores and not-run lines."""
    rows = []
    for name, points in report["points"].items():
        for p in points:
            hits = p["hits_by_source"]
            rows.append((name, p["point"], f"{p['requests_per_s']:.3f}",
                         ms(p["ttft_s"]["p50"]), ms(p["ttft_s"]["p90"]), ms(p["e2e_s"]["p90"]),
                         p["computed_tokens"], hits["device"], hits["host"], hits["disk"],
                         hits["p2p"], f"{p['answered']}/{p['requests'] + p['not_sent']}",
                         p["errors"], p["timeouts"]))
    w = report["workload"]
    mt, hp = w["points"]["multi-turn"], w["points"]["hot-prefix"]
    print_table(
        f"{w['instances']} vLLM-CPU servers + kvhal behind kvhal proxy; multi-turn: "
        f"{mt['conversations']} conversations x {mt['turns']} turns ({mt['initial_tokens']} + "
        f"{mt['turn_tokens']} tokens/turn); hot prefix: {hp['conversations']} sessions sharing "
        f"{hp['shared_prefix_tokens']} tokens; {w['num_blocks']} device blocks each; "
        f"times in ms", ["router", "point", "req/s", "TTFT p50", "TTFT p90", "e2e p90",
                         "computed", "device hit", "host hit", "disk hit", "p2p hit",
                         "answered", "errors", "timeouts"], rows)
    for name, points in report["points"].items():
        for p in points:
            if "router_stats" in p:
                print(f"{name} {p['point']} router stats: {stats_line(p['router_stats'])}")
    for t in report["targets"]:
        state = {None: "not measured", True: "met", False: "NOT met"}[t["met"]]
        ratio = "-" if t["ratio"] is None else f"{t['ratio']:.2f}"
        print(f"target {t['target']}: ratio {ratio}, {state}")
    print_correctness(report["correctness"])
    print("vLLM workers compute on cores: " + "; ".join(
        f"{name} " + " | ".join(",".join(map(str, c)) or "?" for c in r["worker_cores"])
        for name, r in report["routers"].items()))
    for name, why in report["not_run"].items():
        print(f"{name} ({LABELS[name]}): not run: {why}")
    print(f"report: {workdir / 'report.json'}  wall time {report['wall_s']:.0f} s")


def plot(report: dict, path: Path) -> None:
    """Requests/s and TTFT p90 per point, one bar per router."""
    from kvhal.integrations.harness.plot import plot_bars

    def panel(get) -> dict:
        return {point: {name: get(pts[i]) for name, pts in report["points"].items()
                        if name != "reference"} for i, point in enumerate(POINTS)}

    w = report["workload"]
    plot_bars(path, [("requests/s", panel(lambda p: p["requests_per_s"])),
                     ("TTFT p90 (s)", panel(lambda p: p["ttft_s"]["p90"]))],
              f"kvhal bench fleet: {w['instances']} vLLM-CPU servers behind kvhal proxy")


def register(sub: argparse._SubParsersAction) -> None:
    """Add `kvhal bench fleet`."""
    p = sub.add_parser("fleet", help="N vLLM servers with kvhal behind kvhal proxy: "
                       "round-robin, session affinity, KV-aware and KV-aware + p2p routing "
                       "side by side under multi-turn and hot-prefix load (real vLLM-CPU)")
    p.add_argument("--instances", type=positive_int, default=2,
                   help="vLLM servers behind the proxy (default 2)")
    p.add_argument("--routers", type=parse_routers, default=list(ROUTERS),
                   help=f"comma-separated subset of {','.join(ROUTERS)} (default all)")
    g = p.add_argument_group("multi-turn point")
    g.add_argument("--conversations", type=positive_int, default=8,
                   help="conversations, all live at once (default 8)")
    g.add_argument("--turns", type=positive_int, default=10, help="turns per conversation "
                   "(default 10: first turns are a tenth of the requests, so p90 TTFT "
                   "measures the later ones)")
    g.add_argument("--initial-tokens", type=positive_int, default=256,
                   help="user tokens of a conversation's first prompt (default 256)")
    g.add_argument("--turn-tokens", type=positive_int, default=256,
                   help="user tokens each later turn adds after the answer (default 256)")
    g.add_argument("--concurrency", type=positive_int, default=4,
                   help="most requests in flight at once (default 4)")
    g = p.add_argument_group("hot-prefix point")
    g.add_argument("--hot-sessions", type=positive_int, default=16,
                   help="sessions sharing the system prompt (default 16)")
    g.add_argument("--hot-prefix-tokens", type=positive_int, default=2048,
                   help="tokens of the shared system prompt (default 2048)")
    g.add_argument("--hot-tokens", type=positive_int, default=128,
                   help="user tokens of each session's turn (default 128)")
    g.add_argument("--hot-turns", type=positive_int, default=2,
                   help="turns per session (default 2)")
    g.add_argument("--hot-concurrency", type=positive_int, default=8,
                   help="most requests in flight at once (default 8)")
    p.add_argument("--answer-tokens", type=positive_int, default=16,
                   help="tokens generated per request (default 16)")
    p.add_argument("--num-blocks", type=positive_int, default=40,
                   help="vLLM KV cache blocks of 128 tokens, 1 MiB each, per server (default "
                        "40; the reference gets enough for every conversation)")
    p.add_argument("--host-mib", type=positive_int, default=32,
                   help="kvhal host tier per server, MiB (default 32)")
    p.add_argument("--fs-mib", type=positive_int, default=96,
                   help="kvhal fs tier cap per server, MiB (default 96: a little more than "
                        "one server's share of the default multi-turn conversations, 21 MiB "
                        "each at their last turn)")
    add_run_args(p, "fleet", "per server", "report.json, logs, fs tiers and the p2p key",
                 "write requests/s and TTFT p90 per point and router")
    p.set_defaults(func=run)
