"""`kvhal soak --minutes N --seed S`: a small fleet under load and faults, every answer checked.

Two vLLM OpenAI servers with kvhal (host tier, an fs tier on a small tmpfs they share, p2p
between them, a mooncake tier on a shared `mooncake_master` where installed, an obj tier on a
real `moto_server`) serve seeded multi-turn conversations one request at a time
(`--max-num-seqs 1`), while a seeded schedule of faults hits them (`faults.py`). Every answer is
compared with a keep-everything vLLM server's answer to the same request (`load.py`); every
request's wait with its bound (`checks.wait_bound_s`). During the load a p2p client without the
key tries to pull from each server (`checks.nokey_pull`: 0 bytes). After a
clean shutdown the run checks that nothing leaked (no process, no socket listening on a server's
or p2p port, no kvhal memory file in /dev/shm, no temp file in the fs tier, the fs budget held,
`kvhal fsck` finds no corrupt chunk but those the faults damaged) and that kvhal served at
least a tenth of the reusable prompt tokens. Cross-tenant hits are counted per request twice, each against the
prefix the request shares with its own tenant's earlier prompts: from the cached prompt tokens
vLLM reports for it (`usage.prompt_tokens_details.cached_tokens`, device and kvhal hits), and
from kvhal's own accounting, the hit tokens by tier it returns in the reply's
`kv_transfer_params` (`{"kvhal": {"hit_tokens": ...}}`), summed per tenant in the report. Meanwhile each kvhal server's KV events are checked against what the fs and obj tiers can load
(`events.py`: a claim of a missing chunk may not outlive it by more than its tier's bound) and
its hit tokens by source are scraped every few seconds (`report.py`). Writes `soak.json` and
`soak.png` (timeline: requests/s, hit tokens by source, faults) in `--workdir`; prints a summary
table, what each fault cost against the baseline, and the events' staleness per tier. Exit code
0 only if every check held.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from kvhal.report import print_table

from ..vllm.chat import ChatShape, user_tokens
from ..vllm.model import TINY, build_model
from ..vllm.serve_metrics import cached_by_source, delta, loaded_by_tier
from . import checks, drain, fleet
from . import events as soak_events
from . import faults as faultlib
from . import report as soak_report
from .load import (
    Request,
    answer_of,
    common_prefix,
    compare,
    complete,
    conversations,
    is_connection_error,
    now,
    order,
)
from .pull import PullProbe

#: Conversation shape (tiny model, 128-token blocks): 512 tokens, then 128 per turn, 16 out.
SHAPE = {"initial_tokens": 512, "turn_tokens": 128, "answer_tokens": 16, "turns": 4}
#: Bytes of one kvhal chunk of the tiny model (one 128-token block, kvhal's default).
CHUNK_BYTES = TINY.kv_bytes_per_token * 128
#: Most bytes of chunk files the shared fs folder may hold at the end: its budget, shared by
#: both servers through the fs tier's usage ledger (`tiers/fs/ledger.py`; before it, each
#: evicted against its own view and the hour ended 391 KiB over).
FS_LIMIT = fleet.FS_BUDGET
#: Conversation groups per round (two tenants each).
GROUPS = 3
#: Fraction of reusable prompt tokens kvhal must serve, or the soak tested nothing.
MIN_SERVED = 0.1
#: A request's own wait bound (s) before faults add to it: waiting behind the one request a
#: server computes at a time (`--max-num-seqs 1`) on a loaded 2-core machine, plus every tier's
#: deadline (`fleet.TIER_TIMEOUT_S`) for the tiers a load may try in turn.
WAIT_BASE_S = 30.0
#: Faults that kill a server: a request in flight there may fail (`Request.faults_during`).
KILLS = ("kill_restart@", "p2p_kill_mid_pull@")
#: Seconds of load between two keyless p2p pulls (`checks.nokey_pull`) at each server.
NOKEY_EVERY_S = 30.0


class Faulter(threading.Thread):
    """Applies the schedule (`faults.schedule`) from its own thread; records each fault's
    start and end (seconds after `t0`) and what it did."""

    def __init__(self, schedule: list, servers: list, s3, fs_mount: Path, fs_root: Path,
                 mounted: bool, t0: float, scrape, restarted, mooncake=None, probe=None,
                 drain=None):
        super().__init__(name="soak-faults", daemon=True)
        #: `tp2_sigterm`'s run (`drain.sigterm_at_tp2` with the soak's model and seed but its
        #: number) and its results, one per fault.
        self.drain, self.drains = drain, []
        self.schedule, self.servers, self.s3 = schedule, servers, s3
        self.fs_mount, self.fs_root, self.mounted, self.t0 = fs_mount, fs_root, mounted, t0
        self.scrape, self.restarted = scrape, restarted
        self.mooncake, self.probe = mooncake, probe
        self.kills: list[tuple[float, float]] = []      # (kill, ready again) seconds
        self.stops: list[tuple[float, float]] = []      # (SIGSTOP, SIGCONT) seconds
        self.done: list[dict] = []
        self.damaged: set[str] = set()
        self.down = [threading.Event(), threading.Event()]   # set while a server restarts
        self.stop = threading.Event()
        self.restarts: list[threading.Thread] = []
        self.refused: list[dict] = []       # server starts vLLM refused (then retried)
        self.error: str | None = None
        self.idle = threading.Event()       # set when no fault is applied any more
        self.release = threading.Event()    # set when this thread may end

    def run(self) -> None:
        """Apply the schedule, then stay alive until `release`: moto_server and mooncake_master
        restarts are children of this thread, and die with it (`kvhal.procs.die_with_parent`:
        seen as moto gone after the schedule ended, and then every server restart refused)."""
        try:
            for fault in self.schedule:
                if self.stop.wait(max(0.0, fault.at_s - now(self.t0))):
                    break
                start = now(self.t0)
                what = self.apply(fault)
                self.done.append(fault.to_json() | {"start_s": start, "end_s": now(self.t0),
                                                    "what": what})
        except Exception as e:  # noqa: BLE001 - reported as the run's error
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.idle.set()
            self.release.wait()

    def _restart(self, i: int) -> None:
        """Start server `i` again; a start vLLM refuses (e.g. kvhal's obj tier finding the S3
        server down at start) is recorded in `refused` and tried again 5 s later, as a
        supervisor would, up to 3 times."""
        killed = now(self.t0)
        try:
            for attempt in range(3):
                try:
                    self.servers[i].start()
                    self.kills.append((killed, now(self.t0)))
                    return
                except Exception as e:  # noqa: BLE001 - recorded, then retried
                    self.servers[i].kill()
                    self.refused.append({"server": self.servers[i].name, "at_s": now(self.t0),
                                         "error": str(e)[-300:]})
                    if attempt == 2:
                        self.error = f"restart of {self.servers[i].name}: {e}"[:500]
                    time.sleep(5.0)
        finally:
            self.down[i].clear()

    def _sigterm_at_tp2(self, n: int) -> None:
        result = self.drain(n)
        result["at_s"] = now(self.t0)
        self.drains.append(result)

    def join_restarts(self) -> None:
        """Wait for every background restart (and `tp2_sigterm` run)."""
        for thread in self.restarts:
            thread.join()

    def _kill(self, i: int) -> str:
        """SIGKILL server `i` and restart it in the background (the schedule goes on)."""
        server = self.servers[i]
        self.scrape(i)
        self.down[i].set()
        server.kill()
        self.restarted(i)
        restart = threading.Thread(target=self._restart, args=(i,), name="soak-restart",
                                   daemon=True)
        restart.start()
        self.restarts.append(restart)
        return f"{server.name} killed (restarted in the background)"

    def _wait_up(self, *servers: int) -> bool:
        """Wait until none of `servers` is restarting; False if the run ended first."""
        for i in servers:
            while self.down[i].is_set():
                if self.stop.wait(0.2):
                    return False
        return True

    def apply(self, fault) -> str:
        kind = fault.kind
        if kind == "kill_restart":
            if not self._wait_up(fault.target):
                return "skipped: the run ended while its server restarted"
            return self._kill(fault.target)
        if kind == "stop_cont":
            server = self.servers[fault.target]
            start = now(self.t0)
            server.signal_all(signal.SIGSTOP)
            self.stop.wait(faultlib.STOP_S)
            server.signal_all(signal.SIGCONT)
            self.stops.append((start, now(self.t0)))
            return f"{server.name} stopped {faultlib.STOP_S} s"
        if kind == "s3_restart":
            if self.s3 is None:
                return "skipped: no moto_server"
            fleet.restart_same_port(self.s3, self.s3.port)
            self.s3.create_bucket(fleet.BUCKET)
            return f"moto_server killed and restarted on port {self.s3.port} (objects gone)"
        if kind in ("obj_truncate", "obj_overwrite"):
            if self.s3 is None:
                return "skipped: no moto_server"
            name = faultlib.damage_object(self.s3.endpoint, fleet.BUCKET, fleet.S3_KEYS, fault)
            if name is not None:
                self.damaged.add(name)
            return f"{kind} {name}"
        if kind == "mooncake_restart":
            if self.mooncake is None:
                return "skipped: no mooncake_master"
            fleet.restart_same_port(self.mooncake, self.mooncake.rpc_port)
            return f"mooncake_master killed and restarted on port {self.mooncake.rpc_port}"
        if kind == "p2p_kill_mid_pull":
            holder, puller = fault.target, 1 - fault.target
            if not self._wait_up(holder, puller):
                return "skipped: the run ended while a server restarted"
            return self.probe(holder, puller, lambda: self._kill(holder))
        if kind in ("fs_truncate", "fs_overwrite"):
            path = faultlib.damage(str(self.fs_root), fault)
            if path is not None:
                self.damaged.add(path)
            return f"{kind} {path}"
        if kind == "tp2_sigterm":
            if self.drain is None:
                return "skipped: no TP=2 server"
            if len(self.drains) < sum(1 for f in self.done if f["kind"] == kind
                                      and not f["what"].startswith("skipped")):
                # one TP=2 server at a time: two beside the fleet starve a 2-core machine
                return "skipped: the last TP=2 server is still running"
            run = threading.Thread(target=self._sigterm_at_tp2, args=(len(self.restarts),),
                                   name="soak-tp2", daemon=True)
            run.start()
            self.restarts.append(run)
            return "a TP=2 server started in the background (answers, then SIGTERM)"
        if kind == "fs_full":
            if not self.mounted:
                return "skipped: no small filesystem (not root)"
            filler = faultlib.fill(str(self.fs_mount))
            self.stop.wait(faultlib.FULL_S)
            if filler is None:
                return f"filesystem full already (no filler) {faultlib.FULL_S} s"
            os.unlink(filler)
            return f"filesystem full {faultlib.FULL_S} s"
        raise ValueError(kind)


def run(args: argparse.Namespace) -> int:
    """`kvhal soak` (module docstring)."""

    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    seconds = args.minutes * 60.0
    schedule = faultlib.schedule(args.seed, seconds, tuple(args.faults.split(",")),
                                 gap_s=args.fault_gap_s)
    model = build_model(TINY)
    fs_mount = workdir / "fs"
    mounted = fleet.mount_small_fs(fs_mount)
    fs_root = fs_mount / "kv"
    fs_root.mkdir(exist_ok=True)
    s3 = fleet.start_s3()
    mooncake, no_mooncake = (fleet.start_mooncake(workdir / "mooncake_master.log")
                             if args.mooncake
                             else (None, "left out (--no-mooncake)"))
    p2p_ports = [fleet.free_port() for _ in range(2)]
    key_file = fleet.p2p_key(workdir)
    configs = [fleet.kvhal_config(fs_root, None if s3 is None else s3.endpoint, p2p_ports, i,
                                  key_file, None if mooncake is None
                                  else fleet.mooncake_tier(mooncake)) for i in range(2)]
    reference = fleet.Server("reference", model, workdir, None, core=1)
    servers = [fleet.Server(f"kvhal{i}", model, workdir, configs[i], core=i) for i in range(2)]
    scraped: list[dict] = [{}, {}]      # metrics at the last scrape of each server's life
    served = Counter()
    loaded = Counter()                  # chunks by tier, kvhal's own count

    def scrape(i: int) -> None:         # adds a server's counters before it dies
        try:
            now_ = fleet.scrape(servers[i].url)
        except OSError:
            return
        served.update(cached_by_source(delta(scraped[i], now_)))
        loaded.update(loaded_by_tier(delta(scraped[i], now_)))
        scraped[i] = now_

    report: dict = {"seed": args.seed, "minutes": args.minutes, "config": configs,
                    "mooncake_skipped": no_mooncake, "p2p_ports": p2p_ports,
                    "fs_mounted": mounted, "schedule": [f.to_json() for f in schedule]}
    requests: list[Request] = []
    all_pids: set[int] = set()
    try:
        for s in (reference, *servers):      # started side by side
            s.start(wait=False)
        for s in (reference, *servers):
            s.proc.wait_ready()
        t0 = time.monotonic()

        def restarted(i: int) -> None:     # a new process: its counters start from 0
            scraped[i] = {}
        faulter = Faulter(schedule, servers, s3, fs_mount, fs_root, mounted, t0, scrape,
                          restarted, mooncake,
                          PullProbe(reference.url, servers, model, SHAPE["answer_tokens"],
                                    requests, t0),
                          lambda n: drain.sigterm_at_tp2(model, workdir, args.seed, n,
                                                         TINY.vocab_size))
        nokey = checks.NokeyProber(p2p_ports, faulter.down, fs_root, CHUNK_BYTES,
                                   NOKEY_EVERY_S, t0)
        watch = soak_events.EventWatch.of_fleet(servers, fs_root, configs[0], t0)
        watch.faults = faulter.done
        sampler = soak_report.HitSampler(servers, t0)
        watch.start()
        sampler.start()
        faulter.start()
        nokey.start()
        try:
            _drive(args, model, reference, servers, faulter, requests, t0, seconds)
        except Exception as e:  # noqa: BLE001 - the run stops, cleans up and reports it
            report["drive_error"] = f"{type(e).__name__}: {e} (at {now(t0):.0f} s)"[:500]
        nokey.stop.set()
        faulter.stop.set()
        nokey.join()
        faulter.idle.wait()
        faulter.join_restarts()
        report["events"] = watch.finish()
        sampler.stop.set()
        sampler.sample()
        report["hits_by_source"] = sampler.series
        report["faults"] = faulter.done
        report["nokey_pulls"] = nokey.results
        for r in requests:
            r.wait_bound_s = checks.wait_bound_s(WAIT_BASE_S, faulter.kills, faulter.stops,
                                                 r.sent_s, r.done_s)
        report["fault_error"] = faulter.error
        report["tp2_sigterm"] = faulter.drains
        report["starts_refused"] = faulter.refused
        for i in range(2):
            scrape(i)
            all_pids.update(p.pid for p in servers[i].processes())
        left = []
        for s in servers:
            left += s.stop()
        left += reference.stop()
        report["left_processes"] = left + fleet.wait_gone(sorted(all_pids), 10.0)
        faulter.release.set()
        faulter.join()
        report["checks"] = _post_checks(fs_root, faulter.damaged, mounted, report)
        report["checks"]["listening"] = checks.listening(
            [s.port for s in (reference, *servers)] + p2p_ports)
    finally:
        for s in (reference, *servers):
            s.kill()
        if s3 is not None:
            s3.kill()
        if mooncake is not None:
            mooncake.kill()
        if mounted:
            report["fs_held_at_unmount"] = fleet.unmount(fs_mount)
            report["fs_left_mounted"] = os.path.ismount(fs_mount)
    report["requests"] = [r.to_json() for r in requests]
    report["served_by_source"] = dict(served)
    report["loaded_chunks_by_tier"] = dict(loaded)
    report["summary"] = summary = _summarize(requests, report, served)
    (workdir / "soak.json").write_text(json.dumps(report, indent=1))
    _plot(requests, report.get("faults", []), workdir / "soak.png", args.seed,
          report.get("hits_by_source", []))
    _print(summary, report, workdir)
    return 0 if summary["passed"] else 1


def _drive(args, model: Path, reference, servers, faulter: Faulter, requests: list,
           t0: float, seconds: float) -> None:
    """Send the load until `seconds` passed (finishing the round's conversations)."""
    shape = ChatShape(conversations=GROUPS * 2, turns=SHAPE["turns"],
                      initial_tokens=SHAPE["initial_tokens"], turn_tokens=SHAPE["turn_tokens"],
                      answer_tokens=SHAPE["answer_tokens"], concurrency=1, seed=args.seed)
    seen: dict[str, list[list[int]]] = {}       # salt → prompts sent
    round_ = 0
    while now(t0) < seconds:
        convs = conversations(args.seed, round_, GROUPS, shape, TINY.vocab_size)
        for conv, server in order(args.seed, round_, convs, SHAPE["turns"]):
            if now(t0) >= seconds:
                return
            req = Request(conv.name, conv.salt, conv.turn, server, len(conv.prompt), now(t0))
            req.reusable_tokens = max((common_prefix(conv.prompt, p)
                                       for p in seen.get(conv.salt, [])), default=0)
            ref = answer_of(complete(reference.url, str(model), conv.prompt, conv.salt,
                                     SHAPE["answer_tokens"]))
            req.ref_cached_tokens = ref["cached_tokens"]
            req.sent_s = now(t0)        # its latency is the kvhal servers', not the reference's
            got = _ask(servers, server, faulter, conv, req, model)
            req.done_s = now(t0)
            req.faults_during = [f"{f['kind']}@{f['start_s']:.0f}" for f in faulter.done
                                 if f["end_s"] >= req.sent_s and f["start_s"] <= req.done_s]
            if got is None:
                req.verdict = "failed"
            else:
                faulter.probe.served[req.server] = (conv.name, conv.salt, list(conv.prompt))
                req.cached_tokens = got["cached_tokens"]
                req.kvhal_hit_tokens = got["kvhal_hit_tokens"]
                req.verdict, req.max_logprob_diff = compare(got, ref)
            requests.append(req)
            seen.setdefault(conv.salt, []).append(list(conv.prompt))
            conv.prompt = conv.prompt + ref["token_ids"] + _user(shape, conv, conv.turn + 1)
            conv.turn += 1
        round_ += 1


def _user(shape: ChatShape, conv, turn: int) -> list[int]:
    return user_tokens(shape, conv.name, turn, TINY.vocab_size)


def _ask(servers, i: int, faulter: Faulter, conv, req: Request, model: Path) -> dict | None:
    """The kvhal servers' answer, as a router would get it: a request for a server being
    restarted goes to the other one; one that fails to reach a server being killed is retried
    once on the other server (or, if that one is down too, on the first after its restart).
    None if it failed (`req.error` says why)."""
    if faulter.down[i].is_set() and not faulter.down[1 - i].is_set():
        i = 1 - i
    req.server = i
    for attempt in range(2):
        req.tries = attempt + 1
        restarts = servers[i].starts
        try:
            return answer_of(complete(servers[i].url, str(model), conv.prompt, conv.salt,
                                      SHAPE["answer_tokens"]))
        except Exception as e:  # noqa: BLE001 - classified below
            req.error = f"{type(e).__name__}: {e}"
            killed = faulter.down[i].is_set() or servers[i].starts != restarts
            if attempt or not (is_connection_error(e) and killed):
                return None
            # the cut attempt may have stored this prompt under this salt: reusable now
            req.reusable_tokens = max(req.reusable_tokens, len(conv.prompt))
            if not faulter.down[1 - i].is_set():
                i = 1 - i
                continue
            deadline = time.monotonic() + 600
            while faulter.down[i].is_set() and time.monotonic() < deadline:
                time.sleep(0.2)
    return None


def _post_checks(fs_root: Path, damaged: set[str], mounted: bool, report: dict) -> dict:
    """After the clean shutdown: leaks, temp files, budget, fsck."""
    shm = [n for n in os.listdir("/dev/shm") if "kvhal" in n]
    temps = [str(p) for p in fs_root.rglob("*.tmp")]
    used = sum(p.stat().st_size for p in fs_root.rglob("*.kv"))
    out = subprocess.run([sys.executable, "-c", "import sys; from kvhal.cli import main; sys.exit(main())",
                          "fsck", str(fs_root), "--json"],
                         capture_output=True, text=True, check=False)
    try:
        fsck = json.loads(out.stdout)
    except ValueError:
        fsck = {"error": out.stderr[-500:]}
    corrupt = {p.get("path", str(p)) if isinstance(p, dict) else str(p)
               for p in fsck.get("problems", [])}
    unexplained = sorted(p for p in corrupt if not any(d in p for d in damaged))
    return {"dev_shm_kvhal": shm, "temp_files": temps, "fs_bytes": used,
            "fs_budget": FS_LIMIT, "fsck": fsck, "fsck_unexplained": unexplained,
            "left_processes": report.get("left_processes", [])}


def _summarize(requests: list[Request], report: dict, served: Counter) -> dict:
    verdicts = Counter(r.verdict for r in requests)
    reusable = sum(r.reusable_tokens for r in requests)
    kvhal_served = sum(v for k, v in served.items() if k != "device")
    # vLLM's count (device + kvhal) and kvhal's own, each against what the tenant could reuse
    cross = [r for r in requests if r.cached_tokens > r.reusable_tokens
             or sum(r.kvhal_hit_tokens.values()) > r.reusable_tokens]
    late = [r for r in requests if r.done_s - r.sent_s > r.wait_bound_s]
    failed_unexplained = [r for r in requests if r.verdict == "failed"
                          and not any(f.startswith(KILLS) for f in r.faults_during)]
    checks = report.get("checks", {})
    costs = soak_report.fault_costs([r.to_json() for r in requests],
                                     report.get("faults", []))
    events = report.get("events", {})
    failures = {
        "wrong answers": verdicts["wrong"],
        "failed requests not explained by a kill": len(failed_unexplained),
        "cross-tenant hits": len(cross),
        "kvhal memory files in /dev/shm": len(checks.get("dev_shm_kvhal", [])),
        "processes left": len(checks.get("left_processes", [])),
        "temp files in the fs tier": len(checks.get("temp_files", [])),
        "fs budget exceeded": int(checks.get("fs_bytes", 0) > FS_LIMIT),
        "fsck: corrupt chunks no fault made": len(checks.get("fsck_unexplained", [])),
        "kvhal served < 1/10 of reusable tokens": int(kvhal_served < MIN_SERVED * reusable),
        "fault thread error": int(bool(report.get("fault_error"))),
        "event claims of missing chunks past the bound": sum(
            t["violations"] for t in events.get("tiers", {}).values()),
        "event watch error": int(bool(events.get("error"))),
        "load stopped by an error": int(bool(report.get("drive_error"))),
        "p2p bytes a keyless client got": sum(p["bytes"] for p in report.get("nokey_pulls", [])),
        "sockets left listening": len(checks.get("listening", [])),
        "fs left mounted": int(bool(report.get("fs_left_mounted"))),
        "TP=2 chunks lost at a clean shutdown": sum(d["lost"] for d in report.get(
            "tp2_sigterm", [])),
        "TP=2 shutdowns that did not run, answer or exit": sum(
            bool(d["error"] or d.get("left") or not d["answered"])
            for d in report.get("tp2_sigterm", [])),
        "requests over their wait bound": len(late),
    }
    tenants: dict[str, Counter] = {}     # salt → kvhal's hit tokens by tier, its own count
    for r in requests:
        tenants.setdefault(r.salt, Counter()).update(r.kvhal_hit_tokens)
    return {"requests": len(requests), "verdicts": dict(verdicts),
            "reusable_prompt_tokens": reusable, "kvhal_served_tokens": kvhal_served,
            "kvhal_reported_tokens": sum(sum(c.values()) for c in tenants.values()),
            "kvhal_tokens_by_tenant": {salt: dict(c) for salt, c in tenants.items()},
            "served_by_source": dict(served), "fault_costs": costs, "failures": failures,
            "max_wait_s": max((r.done_s - r.sent_s for r in requests), default=0.0),
            "nokey_pulls": len(report.get("nokey_pulls", [])),
            "cross_tenant": [r.to_json() | {"index": requests.index(r)} for r in cross],
            "passed": not any(failures.values()) and bool(requests)}


def _print(summary: dict, report: dict, workdir: Path) -> None:
    v = summary["verdicts"]
    print_table(f"kvhal soak: seed {report['seed']}, {report['minutes']} min",
                ["what", "value"],
                [["requests (answers checked)", summary["requests"]],
                 ["ok / near ties / wrong / failed",
                  (f"{v.get('ok', 0)} / {v.get('near_tie', 0)} / {v.get('wrong', 0)} / "
                   f"{v.get('failed', 0)}")],
                 ["reusable prompt tokens", summary["reusable_prompt_tokens"]],
                 ["served by kvhal (host/disk/p2p)", summary["kvhal_served_tokens"]],
                 ["the same, per request by kvhal itself (tenants)",
                  f"{summary['kvhal_reported_tokens']} "
                  f"({len(summary['kvhal_tokens_by_tenant'])})"],
                 ["by source", json.dumps(summary["served_by_source"])],
                 ["chunks kvhal loaded, by tier", json.dumps(report.get("loaded_chunks_by_tier"))],
                 ["server starts refused (retried)", len(report.get("starts_refused", []))],
                 ["longest wait s", f"{summary['max_wait_s']:.1f}"],
                 ["keyless p2p pulls tried", summary["nokey_pulls"]],
                 ["TP=2 SIGTERMs: chunks on disk at the signal / after the exit",
                  ", ".join(f"{d.get('on_disk_at_sigterm', '-')} / {d['on_disk']} of "
                            f"{d['chunks']}" for d in report.get("tp2_sigterm", [])) or "-"],
                 ["mooncake", report.get("mooncake_skipped") or "in the fleet"]]
                + [[k, n] for k, n in summary["failures"].items()])
    print_table(f"what each fault cost (its requests: in flight at its start or sent until "
                f"{soak_report.AFTER_S:g} s after its end)", soak_report.FAULT_COLUMNS,
                soak_report.fault_rows(summary["fault_costs"]))
    print_table("KV events vs what the tiers can load (claims per tier; times in s)",
                soak_report.EVENT_COLUMNS, soak_report.event_rows(report.get("events", {})))
    for key in ("drive_error", "fault_error"):
        if report.get(key):
            print(f"{key}: {report[key]}")
    print(f"{'PASSED' if summary['passed'] else 'FAILED'}; report {workdir / 'soak.json'}, "
          f"timeline {workdir / 'soak.png'}")


def _plot(requests: list[Request], done: list[dict], path: Path, seed: int,
          hits: list) -> None:
    try:
        from ..plot import plot_soak_timeline
        plot_soak_timeline(path, [r.done_s for r in requests],
                           [r.cached_tokens for r in requests],
                           [r.prompt_tokens for r in requests],
                           [r.verdict for r in requests],
                           [(f["start_s"], f["end_s"], f["kind"]) for f in done],
                           f"kvhal soak, seed {seed}",
                           hits=soak_report.hit_rates(hits, max([r.done_s for r in requests],
                                                                default=0.0)))
    except ImportError as e:     # the plot extra missing: the JSON still holds everything
        print(f"no timeline: {e}", file=sys.stderr)
