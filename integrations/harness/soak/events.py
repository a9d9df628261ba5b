"""Events stay true under faults: each kvhal server's KV events, replayed into a ledger of
claims, checked against what the tiers can actually load.

Each kvhal server publishes vLLM's KV events over ZMQ (`kv_events_config`); `EventWatch`
subscribes to each with the fleet router's own feed (`integrations/pd/events_sub.EventFeed`:
wire format, gaps, replay, restarts) into a `LedgerIndex`, the router's `InstanceIndex` that
also records every `BlockStored`/`BlockRemoved` with its arrival time in a `ClaimLedger`.
Every `CHECK_S` seconds (and once at the end) the ledger's standing claims on the checked
tiers are compared with a snapshot of the stores (`store_state`):

- fs (medium STORAGE, locality LOCAL): the chunk file exists and passes the fs tier's own full
  verification (`tiers/fs/fileio.verify_file`, what `kvhal fsck` runs); a file that exists but
  fails it is "damaged", one that is gone "missing";
- obj (STORAGE, REMOTE): the object is listed in the bucket and passes the same verification
  (`tiers/obj/check.verify_object`, what `kvhal fsck s3://...` runs); moto keeps objects in
  memory: a restart of `moto_server` loses them all.

A claim whose chunk became unloadable is *stale* until its `BlockRemoved` arrives (or the
feed clears the server's index: a publisher restart, lost batches). Its staleness is measured
from when the chunk became unloadable: the start of a fault known to have hit it (`hint`:
the damaged file, the S3 restart) when that falls between the last check that found it
loadable and the first that did not, else that last good check (an upper bound); the lower
bound starts at the first check that found it unloadable, and only it counts toward a
violation (a missing chunk claimed more than `BOUND_S` after a check found it gone). A damaged fs file that kvhal only
discovers at load stays claimed until a load of it fails: a known limitation, reported apart
from missing chunks, as are claims on an S3 server that refuses connections (down: every
claim "unreachable"; kvhal's obj tier keeps its index while a listing fails, so they stand
until loads fail). Chunks of other media (device, host, a peer's or the Mooncake pool's
memory: CPU/REMOTE) are counted, not checked.

Hashes: vLLM publishes a chunk's last block hash as bytes or, by default
(`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`), as its low 64 bits (`maybe_convert_block_hash`);
`external_hash` maps both, and a stored chunk's key, to that int.
"""
from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: Seconds between two checks of the claims against the stores.
CHECK_S = 3.0
#: Longest a claim may outlive its chunk's loadability, per checked tier (seconds): a few
#: times the tier's listing period (fs 1 s, obj 5 s by default) plus one check.
BOUND_S = {"fs": 10.0, "obj": 20.0}
#: Tiers whose claims are checked against the stores.
CHECKED = tuple(BOUND_S)
_MASK = (1 << 64) - 1
#: Why a claimed chunk cannot be loaded: its file or object is gone, fails verification, or
#: its store does not answer (the S3 server down: `UNREACHABLE` maps every chunk to it).
CAUSES = ("missing", "damaged", "unreachable")
#: A tier state whose store refused the connection: nothing in it can be loaded.
UNREACHABLE: Mapping[int, str] = {}


def external_hash(block_hash: bytes | int) -> int:
    """The 64-bit int vLLM publishes for a block hash (`maybe_convert_block_hash`: the low 64
    bits, big-endian), for a hash given as bytes (a chunk key's, or an event's without the
    int conversion) or already as an int."""
    if isinstance(block_hash, int):
        return block_hash & _MASK
    return int.from_bytes(block_hash, "big") & _MASK


def tier_of(medium: str | None, locality: str | None) -> str:
    """The soak's tier of an event's medium and locality: "device" (GPU or none), "host"
    (CPU, local), "fs" (STORAGE, local), "obj" (STORAGE, REMOTE), "pool" (CPU, REMOTE: a
    peer's host memory or the Mooncake pool), else "medium:<medium>"."""
    if medium is None or medium == "GPU":
        return "device"
    remote = locality == "REMOTE"
    if medium == "CPU":
        return "pool" if remote else "host"
    if medium == "STORAGE":
        return "obj" if remote else "fs"
    return f"medium:{medium}"


@dataclass(slots=True)
class Claim:
    """One server's claim that a tier holds a chunk (seconds after the soak's start).

    Attributes:
        since_s: When its `BlockStored` arrived.
        last_ok_s: The last check that found the chunk loadable (None: none yet).
        bad_seen_s: The first check that found it unloadable since, None while loadable.
        cause: "missing" or "damaged" while unloadable.
    """

    since_s: float
    last_ok_s: float | None = None
    bad_seen_s: float | None = None
    cause: str = ""


@dataclass(slots=True)
class TierTally:
    """What the ledger saw of one tier's claims (times in seconds)."""

    claims: int = 0                 # BlockStored chunks credited
    retracted: int = 0              # BlockRemoved chunks (or cleared) of standing claims
    unloadable: dict = field(default_factory=lambda: dict.fromkeys(CAUSES, 0))
    stale_retracted: int = 0        # retracted after their chunk became unloadable
    max_stale_s: float = 0.0        # upper bound over the retracted
    max_stale_lo_s: float = 0.0     # lower bound over the retracted
    standing_bad: dict = field(default_factory=lambda: dict.fromkeys(CAUSES, 0))
    max_standing_s: float = 0.0     # upper bound over claims still standing unloadable
    past_bound: list = field(default_factory=list)  # missing chunks claimed past the bound
    violations: list = field(default_factory=list)  # those whose server was not stopped
    while_stopped: list = field(default_factory=list)

    def to_json(self) -> dict:
        """The tally as a JSON-able dict (violations: at most 20)."""
        return {"claims": self.claims, "retracted": self.retracted,
                "became_unloadable": dict(self.unloadable),
                "stale_retracted": self.stale_retracted,
                "max_stale_s": round(self.max_stale_s, 2),
                "max_stale_lo_s": round(self.max_stale_lo_s, 2),
                "never_retracted": dict(self.standing_bad),
                "max_never_retracted_s": round(self.max_standing_s, 2),
                "violations": len(self.violations), "violation_examples": self.violations[:20],
                "past_bound_while_stopped": len(self.while_stopped)}


class ClaimLedger:
    """Claims per (server, tier, chunk hash), from events, checked against store snapshots.

    Thread-safe: the event thread calls `stored`/`removed`/`cleared`, the checker `check`, the
    fault thread `hint`, under one lock.

    Args:
        bounds: Longest staleness per checked tier before a claim counts as a violation
            (default `BOUND_S`); only these tiers are checked.
    """

    def __init__(self, bounds: Mapping[str, float] = BOUND_S):
        self.bounds = dict(bounds)
        self._lock = threading.Lock()
        self._claims: dict[tuple[str, str], dict[int, Claim]] = {}
        self.tallies: dict[str, TierTally] = {}
        self.other: dict[str, int] = {}           # BlockStored chunks per unchecked tier
        self._hints: list[tuple[str, float, frozenset | None]] = []
        self._stops: list[tuple[str, float, float]] = []
        self.clears: list[dict] = []              # per clear: server, at_s, claims dropped
        self.checks = 0

    def _tally(self, tier: str) -> TierTally:
        return self.tallies.setdefault(tier, TierTally())

    def stored(self, server: str, tier: str, hashes: Iterable[Any], at_s: float) -> None:
        """`server` announced `hashes` (vLLM's external hashes) in `tier` at `at_s`; a claim
        already standing is kept (its state too)."""
        with self._lock:
            if tier not in self.bounds:
                self.other[tier] = self.other.get(tier, 0) + len(list(hashes))
                return
            claims = self._claims.setdefault((server, tier), {})
            for h in hashes:
                h = external_hash(h)
                if h not in claims:
                    claims[h] = Claim(at_s)
                    self._tally(tier).claims += 1
                for clear in self.clears:
                    if clear["server"] == server and 0 <= at_s - clear["at_s"] <= 60.0:
                        clear["recredited_60s"][tier] = clear["recredited_60s"].get(tier, 0) + 1

    def removed(self, server: str, tier: str, hashes: Iterable[Any], at_s: float) -> None:
        """`server` announced `hashes` left `tier` at `at_s`: their claims end (a stale one's
        staleness is recorded)."""
        with self._lock:
            claims = self._claims.get((server, tier))
            if claims is None:
                return
            for h in hashes:
                claim = claims.pop(external_hash(h), None)
                if claim is not None:
                    self._end(server, tier, external_hash(h), claim, at_s)

    def cleared(self, server: str, at_s: float, why: str = "") -> None:
        """`server`'s index was cleared at `at_s` (its publisher restarted, batches lost):
        every claim of it ends."""
        with self._lock:
            dropped = {}
            for (s, tier), claims in self._claims.items():
                if s != server:
                    continue
                dropped[tier] = len(claims)
                for h, claim in claims.items():
                    self._end(server, tier, h, claim, at_s)
                claims.clear()
            self.clears.append({"server": server, "at_s": round(at_s, 2), "why": why[:200],
                                "dropped": dropped, "recredited_60s": {}})

    def _end(self, server: str, tier: str, h: int, claim: Claim, at_s: float) -> None:
        tally = self._tally(tier)
        tally.retracted += 1
        if claim.bad_seen_s is None:
            return
        stale, lo = at_s - self._bad_after(tier, h, claim), at_s - claim.bad_seen_s
        tally.stale_retracted += 1
        tally.max_stale_s = max(tally.max_stale_s, stale)
        tally.max_stale_lo_s = max(tally.max_stale_lo_s, lo)
        if claim.cause == "missing" and lo > self.bounds[tier]:
            tally.past_bound.append({"server": server, "hash": f"{h:016x}",
                                     "cause": claim.cause, "bad_seen_s": claim.bad_seen_s,
                                     "unloadable_s": round(self._bad_after(tier, h, claim), 2),
                                     "retracted_s": round(at_s, 2)})

    def _was_stopped(self, v: dict, end_s: float) -> bool:
        """Whether the server of a claim past its bound (`v`) was stopped (`stopped`) between
        the check that found its chunk gone and `end_s`: a stopped process publishes nothing,
        and a router's health poll drops it."""
        return any(s == v["server"] and start <= end_s and stop >= v["bad_seen_s"]
                   for s, start, stop in self._stops)

    def stopped(self, server: str, start_s: float, end_s: float) -> None:
        """`server` was stopped (SIGSTOP) from `start_s` to `end_s`."""
        with self._lock:
            self._stops.append((server, start_s, end_s))

    def hint(self, tier: str, at_s: float, hashes: Iterable[Any] | None = None) -> None:
        """A fault made chunks of `tier` unloadable at `at_s`: `hashes` (chunk hashes), or
        every chunk of the tier when None (e.g. the S3 server restarted empty)."""
        with self._lock:
            keys = None if hashes is None else frozenset(external_hash(h) for h in hashes)
            self._hints.append((tier, at_s, keys))

    def _bad_after(self, tier: str, h: int, claim: Claim) -> float:
        """When `claim`'s chunk became unloadable: the earliest hint for it after the last
        good check (or the claim) and no later than the first bad check, else that last good
        check (module docstring)."""
        good = claim.since_s if claim.last_ok_s is None else claim.last_ok_s
        times = [t for tt, t, keys in self._hints
                 if tt == tier and good < t <= claim.bad_seen_s and (keys is None or h in keys)]
        return min(times) if times else good

    def check(self, state: Mapping[str, Mapping[int, str]], taken_s: float,
              at_s: float | None = None) -> None:
        """Compare the standing claims with a snapshot of the stores taken at `taken_s`
        (started then): `state[tier]` maps each chunk hash the tier holds to "ok" or
        "damaged"; a hash it lacks is missing. Tiers absent from `state` are not checked this
        time; claims newer than `taken_s` neither (the snapshot may predate their chunk).
        `at_s` (default `taken_s`) is when the check counts as done."""
        at_s = taken_s if at_s is None else at_s
        with self._lock:
            self.checks += 1
            for (_, tier), claims in self._claims.items():
                held = state.get(tier)
                if held is None:
                    continue
                for h, claim in claims.items():
                    if claim.since_s > taken_s:
                        continue
                    verdict = held.get(h, "unreachable" if held is UNREACHABLE else "missing")
                    if verdict == "ok":
                        claim.last_ok_s, claim.bad_seen_s, claim.cause = taken_s, None, ""
                        continue
                    if claim.bad_seen_s is None:
                        claim.bad_seen_s = taken_s
                        self._tally(tier).unloadable[verdict] += 1
                    claim.cause = verdict

    def standing(self, cause: str) -> int:
        """Claims standing now whose chunk the last check found `cause` ("missing",
        "damaged")."""
        with self._lock:
            return sum(c.cause == cause for claims in self._claims.values()
                       for c in claims.values())

    def report(self, end_s: float) -> dict:
        """Per checked tier its `TierTally` (claims standing unloadable at `end_s` counted as
        never retracted, missing ones beyond the bound as violations), claims of unchecked
        tiers, the clears and how many checks ran."""
        with self._lock:
            for (server, tier), claims in self._claims.items():
                tally = self._tally(tier)
                for h, claim in claims.items():
                    if claim.bad_seen_s is None:
                        continue
                    tally.standing_bad[claim.cause] += 1
                    bad_after = self._bad_after(tier, h, claim)
                    tally.max_standing_s = max(tally.max_standing_s, end_s - bad_after)
                    if claim.cause == "missing" and end_s - claim.bad_seen_s > self.bounds[tier]:
                        tally.past_bound.append({"server": server, "hash": f"{h:016x}",
                                                 "cause": claim.cause, "never_retracted": True,
                                                 "bad_seen_s": claim.bad_seen_s,
                                                 "unloadable_s": round(bad_after, 2)})
            for tally in self.tallies.values():
                tally.while_stopped = [v for v in tally.past_bound
                                       if self._was_stopped(v, v.get("retracted_s", end_s))]
                tally.violations = [v for v in tally.past_bound
                                    if v not in tally.while_stopped]
            return {"bounds_s": self.bounds, "checks": self.checks,
                    "tiers": {t: self.tallies[t].to_json() for t in sorted(self.tallies)},
                    "unchecked_claims": dict(self.other), "clears": self.clears}


# -- the stores' state --------------------------------------------------------------------------
class FsState:
    """The fs tier's chunks under `root`: hash → "ok" or "damaged", each file verified in full
    (`verify_file`) once per (size, mtime) it had."""

    def __init__(self, root: str):
        self.root = root
        self._verdicts: dict[str, tuple[tuple[int, int], str]] = {}

    def snapshot(self) -> dict[int, str]:
        """Every chunk file now (a file evicted while scanning is left out)."""
        from kvhal.tiers.chunk_format import CorruptChunk
        from kvhal.tiers.fs.fileio import verify_file
        from kvhal.tiers.fs.format import key_from_name

        out: dict[int, str] = {}
        seen = set()
        for ns_entry in _scandir(self.root):
            try:
                namespace = bytes.fromhex(ns_entry.name)
            except ValueError:
                continue
            for sub in _scandir(os.path.join(ns_entry.path, "chunks")):
                for entry in _scandir(sub.path):
                    key = key_from_name(namespace, entry.name) if len(namespace) == 16 else None
                    if key is None:
                        continue
                    try:
                        st = entry.stat()
                    except OSError:
                        continue
                    stamp = (st.st_size, st.st_mtime_ns)
                    known = self._verdicts.get(entry.path)
                    if known is None or known[0] != stamp:
                        try:
                            verify_file(entry.path, namespace, key)
                            verdict = "ok"
                        except FileNotFoundError:
                            continue
                        except (CorruptChunk, OSError):
                            verdict = "damaged"
                        known = self._verdicts[entry.path] = (stamp, verdict)
                    seen.add(entry.path)
                    h = external_hash(key.block_hash)
                    if out.get(h) != "ok":
                        out[h] = known[1]
        self._verdicts = {p: v for p, v in self._verdicts.items() if p in seen}
        return out


def _scandir(path: str) -> list[os.DirEntry]:
    try:
        return list(os.scandir(path))
    except OSError:
        return []


class ObjState:
    """The obj tier's chunks: hash → "ok" or "damaged" for every object listed under the
    tier's prefix, each fully verified (`tiers/obj/check.verify_object`, what `kvhal fsck
    s3://...` runs) once per (size, last-modified) it had.

    Args:
        tier_config: The obj tier's `secondary_tiers` entry (`store_config`, `prefix`).
    """

    def __init__(self, tier_config: Mapping[str, Any]):
        from kvhal.tiers.obj.client import S3Client
        from kvhal.tiers.obj.config import parse_config

        cfg = parse_config(tier_config)
        self.prefix = cfg.prefix
        self._client = S3Client(cfg.store, timeout_s=5.0, connections=2)
        self._verdicts: dict[str, tuple[tuple[int, float], str]] = {}

    def snapshot(self) -> dict[int, str] | None:
        """Every chunk object now; `UNREACHABLE` when the server refused the LIST or a GET
        after it, None when either failed otherwise (a timeout proves nothing). An object
        whose GET answers 404 is left out (deleted meanwhile); one whose GET failed any other
        way is not taken as missing (the hour's soak counted 597 claims "missing" past their
        bound because moto was killed between the check's LIST and its GETs)."""
        from kvhal.tiers.chunk_format import CorruptChunk
        from kvhal.tiers.obj.check import verify_object
        from kvhal.tiers.obj.client import StoreFailure
        from kvhal.tiers.obj.names import key_from_object, namespace_of

        out: dict[int, str] = {}
        try:
            listed = list(self._client.list(f"{self.prefix}/" if self.prefix else ""))
        except StoreFailure as failure:
            # refused: the server is down, nothing loads; anything else proves nothing
            return UNREACHABLE if failure.errno_name == "ECONNREFUSED" else None
        for name, size, modified in listed:
            namespace = namespace_of(self.prefix, name)
            key = None if namespace is None else key_from_object(
                name.rsplit("/", 1)[0] + "/", namespace, name)
            if key is None:
                continue
            known = self._verdicts.get(name)
            if known is None or known[0] != (size, modified):
                try:
                    verify_object(self._client, name, key, namespace)
                    verdict = "ok"
                except CorruptChunk:
                    verdict = "damaged"
                except StoreFailure as failure:
                    if failure.errno_name == "ENOENT":      # deleted meanwhile
                        continue
                    return UNREACHABLE if failure.errno_name == "ECONNREFUSED" else None
                known = self._verdicts[name] = ((size, modified), verdict)
            h = external_hash(key.block_hash)
            if out.get(h) != "ok":
                out[h] = known[1]
        names = {n for n, _, _ in listed}
        self._verdicts = {n: v for n, v in self._verdicts.items() if n in names}
        return out


def store_state(fs: FsState | None, obj: ObjState | None) -> dict[str, dict[int, str]]:
    """The checked tiers' snapshots (a tier left out when not configured or not listable)."""
    out = {}
    if fs is not None:
        out["fs"] = fs.snapshot()
    if obj is not None:
        listed = obj.snapshot()
        if listed is not None:
            out["obj"] = listed
    return out


# -- the subscribers ----------------------------------------------------------------------------
def _ledger_index(ledger: ClaimLedger, server: str, clock: Callable[[], float]):
    from kvhal.integrations.pd.prefix_index import InstanceIndex

    class LedgerIndex(InstanceIndex):
        """The router's index of one server, also recording each event in the ledger."""

        def apply(self, event: Any) -> None:
            kind = type(event).__name__
            if kind in ("BlockStored", "BlockRemoved"):
                tier = tier_of(event.medium, event.locality)
                hashes = [h for h in event.block_hashes if isinstance(h, (bytes, int))]
                if kind == "BlockStored":
                    ledger.stored(server, tier, hashes, clock())
                else:
                    ledger.removed(server, tier, hashes, clock())
            elif kind == "AllBlocksCleared":
                ledger.cleared(server, clock(), "AllBlocksCleared")
            super().apply(event)

        def clear(self) -> None:
            ledger.cleared(server, clock(), "feed cleared the index")
            super().clear()

    return LedgerIndex()


class EventWatch(threading.Thread):
    """Subscribes to each server's KV events (one `EventFeed` per server on one asyncio loop
    in this thread) and checks the ledger against the stores every `CHECK_S`.

    Args:
        servers: (name, PUB endpoint, replay endpoint or None) per server.
        fs: The fs tier's state, or None.
        obj: The obj tier's state, or None.
        t0: `time.monotonic()` the soak's times count from.
    """

    def __init__(self, servers: list[tuple[str, str, str | None]], fs: FsState | None,
                 obj: ObjState | None, t0: float):
        super().__init__(name="soak-events", daemon=True)
        self.ledger = ClaimLedger()
        self.servers, self.fs, self.obj, self.t0 = servers, fs, obj, t0
        self.feeds: list = []
        #: The faults applied so far (`Faulter.done`, appended by its thread): read at each
        #: check for `hint`s (a damaged file, an S3 restart).
        self.faults: list[dict] = []
        self._hinted = 0
        self._halt = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: str | None = None

    @classmethod
    def of_fleet(cls, servers: list, fs_root: str, kvhal_config: Mapping[str, Any],
                 t0: float) -> EventWatch:
        """A watch of the soak's kvhal servers (`fleet.Server`: `name`, `events_port`,
        `replay_port`) and the fs and obj tiers of their `kvhal_config`."""
        tiers = {t["type"]: t for t in kvhal_config.get("secondary_tiers", [])}
        return cls([(s.name, f"tcp://127.0.0.1:{s.events_port}",
                     f"tcp://127.0.0.1:{s.replay_port}") for s in servers],
                   FsState(str(fs_root)) if "fs" in tiers else None,
                   ObjState(tiers["obj"]) if "obj" in tiers else None, t0)

    def _take_faults(self) -> None:
        """Hints of the faults applied since the last call; a killed server's claims end at
        its kill (as a router drops an instance its health poll finds dead)."""
        from kvhal.tiers.fs.format import key_from_name

        new, self._hinted = self.faults[self._hinted:], len(self.faults)
        for f in new:
            if f["kind"] == "stop_cont":
                self.ledger.stopped(self.servers[f["target"]][0], f["start_s"], f["end_s"])
            elif (f["kind"] in ("kill_restart", "p2p_kill_mid_pull")
                  and "skipped" not in f.get("what", "")):
                # a router's health poll drops a dead instance (`EventFeed.drop`)
                self.ledger.cleared(self.servers[f["target"]][0], f["start_s"], "killed")
            elif f["kind"] == "s3_restart" and "skipped" not in f.get("what", ""):
                self.ledger.hint("obj", f["start_s"])
            elif f["kind"] in ("fs_truncate", "fs_overwrite", "obj_truncate", "obj_overwrite"):
                name = f.get("what", "").rsplit("/", 1)[-1]
                key = key_from_name(b"\0" * 16, name)
                if key is not None:
                    self.ledger.hint(f["kind"].split("_")[0], f["start_s"], [key.block_hash])

    def now(self) -> float:
        """Seconds since `t0`."""
        return time.monotonic() - self.t0

    def run(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception as e:  # noqa: BLE001 - reported with the events
            self.error = f"{type(e).__name__}: {e}"

    async def _main(self) -> None:
        import zmq.asyncio
        from kvhal.integrations.pd.events_sub import EventFeed

        ctx = zmq.asyncio.Context()
        self.feeds = [EventFeed(name, pub, replay, _ledger_index(self.ledger, name, self.now))
                      for name, pub, replay in self.servers]
        tasks = [asyncio.create_task(f.run(ctx)) for f in self.feeds]
        try:
            while not self._halt.is_set():
                await asyncio.sleep(CHECK_S)
                await self.check()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            ctx.term()

    async def check(self) -> None:
        """One check of the ledger against the stores (the scan runs off the loop, so
        events keep arriving meanwhile)."""
        self._take_faults()
        taken = self.now()
        state = await asyncio.to_thread(store_state, self.fs, self.obj)
        self.ledger.check(state, taken, self.now())

    def finish(self, settle_s: float = 12.0, timeout_s: float = 30.0) -> dict:
        """After the load, before the servers stop: check again until no claim of a missing
        chunk stands or `settle_s` passed (removals in flight arrive), stop, and report."""
        deadline = time.monotonic() + settle_s
        while True:
            self._take_faults()
            taken = self.now()
            self.ledger.check(store_state(self.fs, self.obj), taken, self.now())
            if not self.ledger.standing("missing") or time.monotonic() >= deadline:
                break
            time.sleep(1.0)
        self._halt.set()
        self.join(timeout_s)
        out = self.ledger.report(self.now())
        out["feeds"] = {f.name: f.to_dict() for f in self.feeds}
        out["error"] = self.error
        return out
