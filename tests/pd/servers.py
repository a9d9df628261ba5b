"""Processes and servers the proxy tests talk to over real sockets.

`ProxyProcess` runs `kvhal proxy ...` as its own process (`--port 0`: a free port). `RecordingBackend`
is a tiny HTTP server (aiohttp, on one event-loop thread shared by all of them) that records
every body the proxy sends it, so a test can check the exact legs; it answers with a fixed
JSON echo, never pretending to be vLLM. `FaultyBackend` answers its legs with an HTTP error
status on demand (a fault a real vLLM does not produce on request).
"""
from __future__ import annotations

import asyncio
import http.client
import itertools
import json
import re
import selectors
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from kvhal.procs import die_with_parent

KVHAL = str(Path(sys.executable).with_name("kvhal"))
#: urllib without any HTTP proxy from the environment: the tests talk to 127.0.0.1.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
STARTUP = re.compile(r"kvhal proxy: listening on (http://\S+) ")


def request(url: str, body: dict | None = None, timeout_s: float = 60.0
            ) -> tuple[int, dict | str]:
    """GET (`body` None) or POST JSON `url`; returns (status, decoded JSON or raw text), for
    error statuses too."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with _OPENER.open(req, timeout=timeout_s) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


class ProxyProcess:
    """`kvhal proxy` in its own process; `url` once its startup line is out.

    Args:
        command: The command line, e.g. `[KVHAL, "proxy", "--port", "0", ...]` or a README
            block run by bash (which execs the proxy).
        log: File receiving the proxy's stderr (its log lines).
        env: The process's environment (default: this one's).
        timeout_s: Seconds to wait for the startup line.

    Raises:
        RuntimeError: the proxy exited or printed no startup line in time (with its log).
    """

    def __init__(self, command: list[str], log: Path, env: dict | None = None,
                 timeout_s: float = 60.0):
        self.log = log
        self._log = log.open("w")
        self.proc = subprocess.Popen(command, text=True, env=env, stdout=subprocess.PIPE,
                                     stderr=self._log, preexec_fn=die_with_parent)
        self.startup = self._read_line(timeout_s)
        m = STARTUP.match(self.startup)
        if m is None:
            self.kill()
            raise RuntimeError(f"no startup line from kvhal proxy: {self.startup!r}; log: "
                               f"{log.read_text()[-3000:]}")
        self.url = m.group(1)

    def _read_line(self, timeout_s: float) -> str:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            return ""
        return self.proc.stdout.readline().strip()

    def health(self) -> tuple[int, dict]:
        """The proxy's `GET /health` (status, JSON)."""
        return request(f"{self.url}/health", timeout_s=30)

    def wait_health(self, predicate, timeout_s: float = 30.0) -> dict:
        """Poll `/health` until `predicate(json)` holds; returns that JSON.

        Raises:
            AssertionError: it did not hold within `timeout_s` (with the last answer).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            _, state = self.health()
            if predicate(state) or time.monotonic() > deadline:
                assert predicate(state), state
                return state
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        """Send `sig`; returns the exit code (SIGKILL after `timeout_s`)."""
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        finally:
            self.kill()

    def kill(self) -> None:
        """SIGKILL it if still running (teardown)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.proc.stdout.close()
        self._log.close()


class _Loop:
    """One event loop on a daemon thread serving every recording backend of the process."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def run(self, coro, timeout_s: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)


_LOOP: _Loop | None = None
#: Arrival and answer order across all backends (read and written on the loop thread only).
_SEQ = itertools.count()


def _loop() -> _Loop:
    global _LOOP
    if _LOOP is None:
        _LOOP = _Loop()
    return _LOOP


@dataclass
class Received:
    """One request a backend got: `seq` orders arrivals and answers across all backends."""

    path: str
    headers: dict
    body: dict | None
    seq: int
    transport: object = None          # the connection it came on (asyncio transport)
    answered_seq: int | None = None
    waited_ok: bool | None = None     # the `answer_after` condition held in time
    raw: bytes = b""                  # the body's bytes as they arrived


class RecordingBackend:
    """A recording HTTP server on 127.0.0.1 (see the module docstring).

    Answers `POST /v1/*` with `{"backend": name, "echo": body}` (or, for `"stream": true`,
    SSE events `data: {"backend", "n": i}` for i in 0..2 then `data: [DONE]`, each after the
    previous once `release()` was called), `GET /v1/models` with `{"backend": name}`,
    `GET /health` with `health_status`.

    Attributes:
        answer_after: (other backend, timeout_s): hold each answer until `other` received a
            request (or the timeout passed; `Received.waited_ok` says which).
    """

    def __init__(self, name: str):
        self.name = name
        self.received: list[Received] = []
        self.health_status = 200
        self.answer_after: tuple[RecordingBackend, float] | None = None
        self._loop = _loop()
        self._runner = None
        self._arrived: asyncio.Event | None = None
        self._release: asyncio.Queue | None = None
        self.url = self._loop.run(self._start())

    async def _start(self) -> str:
        self._arrived, self._release = asyncio.Event(), asyncio.Queue()
        app = web.Application(client_max_size=64 << 20)   # as vLLM: no 1 MiB cap
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/{tail:.*}", self._post)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    @property
    def legs(self) -> list[Received]:
        """The `POST /v1/...` requests received, in arrival order."""
        return [r for r in self.received if r.path.startswith("/v1/") and r.body is not None]

    def connection_closed(self, rec: Received) -> bool:
        """Whether the connection `rec` came on is closed or closing (thread-safe)."""
        async def check() -> bool:
            return rec.transport is None or rec.transport.is_closing()
        return self._loop.run(check())

    def release(self) -> None:
        """Let a held SSE stream send its next event (thread-safe)."""
        self._loop.loop.call_soon_threadsafe(self._release.put_nowait, None)

    def stop(self) -> None:
        """Close the server: connections to `url` are refused from now on."""
        self._loop.run(self._runner.cleanup())

    async def _health(self, request: web.Request) -> web.Response:
        self.received.append(Received(request.path, dict(request.headers), None, next(_SEQ)))
        return web.json_response({}, status=self.health_status)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"backend": self.name})

    async def _post(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        rec = Received(request.path, dict(request.headers), json.loads(raw), next(_SEQ),
                       request.transport, raw=raw)
        self.received.append(rec)
        self._arrived.set()
        if self.answer_after is not None:
            other, timeout_s = self.answer_after
            try:
                await asyncio.wait_for(other._arrived.wait(), timeout_s)
                rec.waited_ok = True
            except asyncio.TimeoutError:
                rec.waited_ok = False
        try:
            return await self._answer(request, rec)
        finally:
            rec.answered_seq = next(_SEQ)

    async def _answer(self, request: web.Request, rec: Received) -> web.StreamResponse:
        if not rec.body.get("stream"):
            return web.json_response({"backend": self.name, "echo": rec.body})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(3):
                if i:
                    await asyncio.wait_for(self._release.get(), 30)
                await resp.write(f"data: {json.dumps({'backend': self.name, 'n': i})}\n\n"
                                 .encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:     # the proxy closed the leg
            pass
        return resp


class FaultyBackend(RecordingBackend):
    """A recording backend answering every `POST /v1/...` with HTTP `status` and a JSON
    error body (it still records the request)."""

    def __init__(self, name: str, status: int):
        self.status = status
        super().__init__(name)

    async def _answer(self, request: web.Request, rec: Received) -> web.StreamResponse:
        return web.json_response({"error": {"message": f"{self.name} refuses", "code":
                                            self.status}}, status=self.status)



class SSEStream:
    """One streamed POST through http.client: `next_event()` returns each `data:` payload as
    soon as it arrives (a read waits at most `timeout_s`, then raises `TimeoutError`)."""

    def __init__(self, url: str, body: dict, timeout_s: float = 30.0):
        parts = urllib.parse.urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
        self.conn.request("POST", parts.path, json.dumps(body),
                          {"Content-Type": "application/json"})
        self.resp = self.conn.getresponse()
        self._buf = b""

    def next_event(self) -> str:
        """The next event's data ("[DONE]" last).

        Raises:
            EOFError: the body ended cleanly (its last chunk came).
            http.client.IncompleteRead: the connection closed mid-body.
        """
        while b"\n\n" not in self._buf:
            data = self.resp.read1(65536)     # unlike readline, tells a cut body from an end
            if not data:
                raise EOFError("stream ended")
            self._buf += data
        event, self._buf = self._buf.split(b"\n\n", 1)
        return event.removeprefix(b"data: ").decode()

    def close(self) -> None:
        """Drop the connection."""
        self.conn.close()


class BackendProcess:
    """`backend_process.py NAME`: a tiny echo backend in its own process, which `freeze()`
    stops with SIGSTOP (it keeps accepting connections, the kernel queues them, but never
    answers) and `thaw()` resumes with SIGCONT.

    Raises:
        RuntimeError: it printed no `listening on URL` line within `timeout_s`.
    """

    def __init__(self, name: str, timeout_s: float = 30.0):
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("backend_process.py")), name],
            text=True, stdout=subprocess.PIPE, preexec_fn=die_with_parent)
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        line = self.proc.stdout.readline().strip() if sel.select(timeout_s) else ""
        if not line.startswith("listening on http://"):
            self.stop()
            raise RuntimeError(f"backend process {name}: no startup line, got {line!r}")
        self.url = line.removeprefix("listening on ")

    def freeze(self) -> None:
        """SIGSTOP: connections are still accepted, nothing is answered."""
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT: it answers again (what it queued meanwhile too)."""
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """SIGKILL it (a stopped process too) and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.proc.stdout.close()
