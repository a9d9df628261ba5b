"""What the P/D proxy (`proxy.Proxy`) and the fleet router (`fleet.Fleet`) share as aiohttp
applications in front of vLLM servers: the OpenAI route table, the client session, the health
poll loop, body checks, error answers and passing a backend's answer through."""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from .backends import Backend
from .legs import BodyError, client_params

log = logging.getLogger("kvhal.proxy")

#: Largest client body accepted (aiohttp's default, 1 MiB, is a 150K-token prompt of ids).
MAX_BODY_BYTES = 256 << 20
#: Client headers forwarded to the backends (API keys).
FORWARDED_HEADERS = ("Authorization",)
#: Backend answer headers passed to the client (with the status and the body).
PASSED_HEADERS = ("Content-Type", "Content-Encoding")


def error_response(status: int, message: str, backend: str | None = None) -> web.Response:
    """The JSON error answer `{"error": {"message", "type": "kvhal_proxy_error", "backend",
    "code"}}` with HTTP `status`; `backend` names the backend at fault, if any."""
    return web.json_response({"error": {"message": message, "type": "kvhal_proxy_error",
                                        "backend": backend, "code": status}}, status=status)


def failure_text(exc: BaseException) -> str:
    """One line saying why a backend call failed, without a traceback."""
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def body_problem(body: object) -> web.Response | None:
    """The 400 answer for a decoded client body that is not a JSON object or whose
    `kv_transfer_params` is not one; None when `body` is fine."""
    if not isinstance(body, dict):
        return error_response(400, f"request body must be a JSON object, got "
                                   f"{type(body).__name__}")
    try:
        client_params(body)
    except BodyError as exc:
        return error_response(400, str(exc))
    return None


def verdict(backend: Backend) -> str:
    """A backend's URL and health for a startup line: "URL (healthy)" / "URL (unhealthy: why)"."""
    b = backend
    return f"{b.url} ({'healthy' if b.healthy else 'unhealthy: ' + str(b.last_error)})"


def passed_through(upstream: aiohttp.ClientResponse) -> web.StreamResponse:
    """The client's response (not prepared yet) for a backend's answer `upstream`: its status,
    reason, `PASSED_HEADERS` and content length."""
    resp = web.StreamResponse(status=upstream.status, reason=upstream.reason)
    for name in PASSED_HEADERS:
        if name in upstream.headers:
            resp.headers[name] = upstream.headers[name]
    if upstream.content_length is not None:
        resp.content_length = upstream.content_length
    return resp


class Front:
    """Base of the aiohttp applications in front of vLLM servers.

    Subclasses set `config` (with `host`, `port`, `connect_timeout_s`, `health_interval_s` and
    `shutdown_timeout_s`, seconds) and
    implement `_forward(request, chat=...)`, `models`, `health`, `_start`, `_stop`,
    `_poll_all` and `describe(url)` (the startup line); `_routes()` adds routes of their own.
    """

    config: object
    session: aiohttp.ClientSession | None

    def app(self) -> web.Application:
        """The aiohttp application serving the routes of the module docstring."""
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        for path, handler in self._routes():
            app.router.add_get(path, handler)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    def _routes(self) -> list[tuple[str, object]]:
        """Extra GET routes: (path, handler) pairs."""
        return []

    def _client_session(self, **kw) -> aiohttp.ClientSession:
        """The session reaching the backends: no connection limit, no total timeout, connect
        timeout `config.connect_timeout_s`, bodies passed on as they come (not decompressed);
        `kw` adds aiohttp.ClientSession arguments."""
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s),
            auto_decompress=False, skip_auto_headers=("Accept-Encoding",), **kw)

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            await self._poll_all()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """`POST /v1/completions` (module docstring)."""
        return await self._forward(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """`POST /v1/chat/completions` (module docstring)."""
        return await self._forward(request, chat=True)

    async def run(self, announce: Callable[[str], Any] = print) -> None:
        """Serve `app()` on config.host:config.port until SIGTERM or SIGINT, then shut down
        gracefully (module docstrings of `proxy` and `fleet`): the listener closes and
        requests in flight get `config.shutdown_timeout_s` seconds to finish.

        `announce` receives `describe("http://HOST:PORT")` (the bound address, every backend
        with its first health verdict) once listening.

        Raises:
            OSError: the listen address cannot be bound.
        """
        # handler_cancellation: a client that leaves cancels its handler at once, which closes
        # the legs' connections (vLLM aborts those requests), even while no token is due.
        runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True,
                               shutdown_timeout=self.config.shutdown_timeout_s)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.config.host, self.config.port)
            await site.start()
            bound_host, bound_port = runner.addresses[0][:2]
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            announce(self.describe(f"http://{bound_host}:{bound_port}"))
            sys.stdout.flush()
            await stop.wait()
            log.info("shutting down: finishing requests in flight")
        finally:
            await runner.cleanup()
