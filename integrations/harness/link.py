"""Emulated links: kvhal's processes inside a network namespace whose loopback is shaped.

`EmulatedLink` creates a network namespace of its own (named `kvhal-<pid>-<n>`: the creating
process's id and a counter), brings its loopback up and shapes it with a `tc` token bucket
(`tbf rate R burst 256kb latency 2s` on `lo`: every byte between two sockets on 127.0.0.1
inside the namespace crosses it once per direction). Processes run inside with `command` /
`popen` (`ip netns exec`); `set_rate` changes the rate while they run. Closing it ends the
processes still inside and deletes the namespace (its qdisc goes with it); so does interpreter
exit (atexit), and `sweep_stale` deletes namespaces of this naming whose creating process is
gone (a killed run). Nothing outside the namespaces it names is touched.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and the `ip` and `tc` tools: `unavailable()`
says why not. RTT emulation needs `netem`, which not every kernel has (`rtt_unavailable()`);
a link asked for with an RTT where it is missing is refused (`LinkError`), never run without.
"""
from __future__ import annotations

import atexit
import itertools
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Self

#: Names of the namespaces this helper makes: `kvhal-<creator pid>-<n>`.
NAME_PREFIX = "kvhal-"
_NAME = re.compile(r"kvhal-(\d+)-(\d+)")
#: Token bucket of the shaping qdisc: large enough for one 64 KiB TSO segment at any rate
#: this helper takes, and a queue of 2 s before `tbf` drops (never reached by TCP's window).
BURST = "256kb"
QUEUE_LATENCY = "2s"
#: Rates a link takes, bits per second.
MIN_RATE_BPS, MAX_RATE_BPS = 1e5, 1e11
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}
_counter = itertools.count(1)
_open: dict[str, EmulatedLink] = {}
_open_lock = threading.Lock()


class LinkError(RuntimeError):
    """An emulated link cannot be made or changed; names the value or the command and its
    stderr."""


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """One emulated link: `rate_bps` bits per second, `rtt_s` round-trip seconds (None:
    none added)."""

    rate_bps: float
    rtt_s: float | None = None

    @property
    def label(self) -> str:
        """The rate as `tc` writes it ("20mbit", "25gbit"), and ",RTT" when one is set."""
        rate = _rate_text(self.rate_bps)
        return rate if self.rtt_s is None else f"{rate},{self.rtt_s * 1e3:g}ms"


def _rate_text(bps: float) -> str:
    for unit, scale in (("g", 1e9), ("m", 1e6), ("k", 1e3)):
        if bps >= scale and (bps / scale) == int(bps / scale):
            return f"{int(bps / scale)}{unit}bit"
    return f"{int(bps)}bit"


def parse_rate(text: str) -> float:
    """Bits per second of "20mbit", "25gbit", "100kbit", "1.5gbit" or a plain number of
    bits per second.

    Raises:
        ValueError: not such a rate, or outside [`MIN_RATE_BPS`, `MAX_RATE_BPS`].
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmg]?)(?:bit)?\s*", text.lower())
    if not match:
        raise ValueError(f"not a link rate (e.g. 20mbit, 25gbit): {text!r}")
    bps = float(match.group(1)) * _UNITS[match.group(2)]
    if not MIN_RATE_BPS <= bps <= MAX_RATE_BPS:
        raise ValueError(f"link rate {text!r} outside [100kbit, 100gbit]")
    return bps


def parse_link(text: str) -> LinkSpec:
    """`RATE[,RTT]` ("20mbit", "10gbit,2ms"; RTT in ms, or with a "ms"/"s" suffix).

    Raises:
        ValueError: a bad rate or RTT (the message quotes it).
    """
    rate, _, rtt = text.partition(",")
    if not rtt:
        return LinkSpec(parse_rate(rate))
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*", rtt.lower())
    if not match:
        raise ValueError(f"not a round-trip time (e.g. 2ms): {rtt!r}")
    seconds = float(match.group(1)) / (1 if match.group(2) == "s" else 1e3)
    return LinkSpec(parse_rate(rate), seconds)


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(argv), check=False, capture_output=True, text=True, timeout=30)
    if check and done.returncode:
        raise LinkError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def unavailable() -> str | None:
    """Why emulated links cannot be made here (no `ip`/`tc`, not permitted to add a network
    namespace or a `tbf` qdisc), or None when they can. Tries once with a namespace of its own,
    removed again."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the {tool!r} tool is not installed"
    try:
        with EmulatedLink(LinkSpec(1e9)):
            pass
    except LinkError as exc:
        return f"cannot make a shaped network namespace: {exc}"
    return None


def rtt_unavailable() -> str | None:
    """Why a link with an RTT cannot be made here (the kernel's `sch_netem` is missing, or no
    namespace can be made), or None."""
    reason = unavailable()
    if reason:
        return reason
    with EmulatedLink(LinkSpec(1e9)) as link:
        done = _run(["tc", "-n", link.name, "qdisc", "add", "dev", "lo", "parent", "1:1",
                     "handle", "10:", "netem", "delay", "1ms"], check=False)
        if done.returncode:
            return f"tc netem is not available ({done.stderr.strip() or 'refused'})"
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    done = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def stale() -> list[str]:
    """The `kvhal-<pid>-<n>` namespaces whose creating process is gone (left behind by a run
    killed before it could clean up; those of live runs, e.g. other test workers, are not)."""
    return [name for name in _namespaces()
            if (match := _NAME.fullmatch(name)) and not _pid_alive(int(match.group(1)))]


def sweep_stale() -> list[str]:
    """Delete every namespace of `stale()`, ending the processes still inside; returns their
    names."""
    gone = stale()
    for name in gone:
        _delete(name)
    return gone


def _pids_in(name: str) -> list[int]:
    done = _run(["ip", "netns", "pids", name], check=False)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


def _delete(name: str, grace_s: float = 3.0) -> None:
    """End the processes inside namespace `name` (SIGTERM, then SIGKILL after `grace_s`),
    then delete it (its loopback and qdisc go with it)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = _pids_in(name)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if _pid_alive(p)]
            time.sleep(0.02)
        if not pids:
            break
    _run(["ip", "netns", "delete", name], check=False)


class EmulatedLink:
    """A network namespace of its own whose loopback runs at `spec.rate_bps` (see the module
    docstring). A context manager; `close` is idempotent.

    Args:
        spec: The link (`parse_link`), or a rate in bits per second.

    Attributes:
        name: The namespace's name (`kvhal-<pid>-<n>`).
        spec: The link as now shaped (`set_rate` changes it).

    Raises:
        LinkError: the namespace or the qdisc cannot be made (not root, no `tbf`), or the spec
            has an RTT and `netem` is missing; whatever was made is removed first.
    """

    def __init__(self, spec: LinkSpec | float):
        self.spec = spec if isinstance(spec, LinkSpec) else LinkSpec(float(spec))
        self.name = f"{NAME_PREFIX}{os.getpid()}-{next(_counter)}"
        self._closed = False
        _run(["ip", "netns", "add", self.name])
        with _open_lock:
            _open[self.name] = self
        try:
            _run(["ip", "-n", self.name, "link", "set", "lo", "up"])
            self._shape("add", self.spec)
        except LinkError:
            self.close()
            raise

    def _shape(self, verb: str, spec: LinkSpec) -> None:
        tc = ["tc", "-n", self.name, "qdisc", verb, "dev", "lo"]
        _run([*tc, "root", "handle", "1:", "tbf", "rate", _rate_text(spec.rate_bps),
              "burst", BURST, "latency", QUEUE_LATENCY])
        if spec.rtt_s is not None:   # one-way delay on lo's egress: both directions cross it
            delay = f"{spec.rtt_s / 2 * 1e6:.0f}us"
            try:
                _run([*tc, "parent", "1:1", "handle", "10:", "netem", "delay", delay])
            except LinkError as exc:
                raise LinkError(f"link {spec.label}: an RTT needs the kernel's tc netem, "
                                f"refused here: {exc}") from None

    def set_rate(self, rate_bps: float) -> None:
        """Change the rate now (`tc qdisc change`); connections stay open.

        Raises:
            LinkError: the link is closed, or tc refused.
        """
        if self._closed:
            raise LinkError(f"link {self.name} is closed")
        spec = LinkSpec(rate_bps, self.spec.rtt_s)
        _run(["tc", "-n", self.name, "qdisc", "change", "dev", "lo", "root", "handle", "1:",
              "tbf", "rate", _rate_text(rate_bps), "burst", BURST, "latency", QUEUE_LATENCY])
        self.spec = spec

    def qdisc(self) -> str:
        """`tc qdisc show dev lo` inside the namespace (what is shaping it now)."""
        return _run(["tc", "-n", self.name, "qdisc", "show", "dev", "lo"]).stdout.strip()

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside the namespace (`ip netns exec NAME ...`)."""
        return ["ip", "netns", "exec", self.name, *argv]

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start `argv` inside the namespace (`subprocess.Popen` keywords pass through); it
        is ended by `close` if still running."""
        return subprocess.Popen(self.command(argv), **kwargs)

    def run(self, argv: Sequence[str], *, check: bool = False, **kwargs
            ) -> subprocess.CompletedProcess:
        """Run `argv` inside the namespace to the end (`subprocess.run` keywords)."""
        return subprocess.run(self.command(argv), check=check, **kwargs)

    def close(self) -> None:
        """End the processes still inside and delete the namespace and its qdisc."""
        if self._closed:
            return
        self._closed = True
        with _open_lock:
            _open.pop(self.name, None)
        _delete(self.name)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EmulatedLink({self.name}, {self.spec.label})"


@atexit.register
def _close_all() -> None:
    with _open_lock:
        links = list(_open.values())
    for link in links:
        link.close()
