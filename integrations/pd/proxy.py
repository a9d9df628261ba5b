"""The P/D proxy: OpenAI requests in, a prefill leg and a decode leg out (aiohttp).

Routes:
    POST /v1/completions, /v1/chat/completions: one disaggregated request. The proxy invents
        an unguessable `kv_request_id` (`secrets.token_urlsafe(24)`, 192 bits), sends the
        prefill leg (`legs.prefill_body`) to a prefiller and the decode leg
        (`legs.decode_body`) to a decoder, and answers with the decoder's response passed
        through: its status, content type and body bytes, streamed (SSE) chunks written to the
        client as each arrives, never buffered.
    GET /v1/models: a healthy decoder's answer, passed through.
    GET /health: 200 with every backend's state while a decoder is healthy, else 503.

Orders (`Order`): "prefill-first" sends the decode leg after the prefill leg answered
(vLLM's reference proxy); "concurrent" sends both at once (llm-d's router); "decode-first"
sends the decode leg and, once its request is written to the decoder's socket, the prefill
leg. In the last two the decoder waits for chunks the prefiller has not parked yet.

Failures, answered as JSON `{"error": {"message", "type": "kvhal_proxy_error", "backend",
"code"}}`, never a traceback:
    400: the client's body is not a JSON object, or its `kv_transfer_params` is not one.
    413: the body is over `MAX_BODY_BYTES`.
    502: the chosen decoder could not be reached (connection refused, reset, timeout);
        `backend` names it and the decoder is marked unhealthy. Not retried elsewhere.
    503: no decoder is healthy; `message` names each one and why.
A decoder's own error answer (4xx/5xx) is passed through unchanged. A decoder failing
mid-stream ends the client's response without its terminating chunk (an incomplete body, so
the client sees an error, never a clean truncated answer).

The prefill leg never fails a request. No healthy prefiller, or (prefill-first) a prefill
leg that failed — unreachable, a 5xx, or over `prefill_timeout_s` — sends the decode leg
without `remote_prefiller`: the decoder computes the whole prompt (a warning is logged and the
prefiller's `failures` counted in `/health`). A prefill 4xx in prefill-first is the client's
request being refused: it is passed through to the client and no decode leg is sent. In the
other orders the decode leg already carries `remote_prefiller` when the prefill leg fails;
the decoder's p2p tier waits for the id (kvhal: up to the decoder's `fetch_wait_s`, or the
prefiller's `arrival_timeout_s` if set) and computes the prompt itself. A failed or
abandoned decode leg cancels its prefill leg (closing the connection aborts it in vLLM, so
its parked KV is not held until the tier's timeout).

A client that disconnects cancels its request: both legs' connections are closed, which
aborts them in vLLM.

Shutdown (SIGTERM, SIGINT): the listener closes, requests in flight finish (up to
`shutdown_timeout_s`), the health poller stops, the client session closes; exit code 0.
"""
from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import secrets
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from types import SimpleNamespace

import aiohttp
from aiohttp import web

from .backends import Backend, NoHealthyBackend, Pool
from .front import (FORWARDED_HEADERS, MAX_BODY_BYTES, Front, body_problem, error_response,
                    failure_text, passed_through, verdict)
from .legs import RemotePrefill, decode_body, prefill_body

log = logging.getLogger("kvhal.proxy")

#: Bytes of randomness in a `kv_request_id` (base64url: 32 characters).
REQUEST_ID_BYTES = 24
#: Header pinning a request to one data-parallel rank of a vLLM API server.
DP_RANK_HEADER = "X-data-parallel-rank"


class Order(enum.Enum):
    """When the decode leg is sent relative to the prefill leg (see the module docstring)."""

    PREFILL_FIRST = "prefill-first"
    CONCURRENT = "concurrent"
    DECODE_FIRST = "decode-first"


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """Everything `kvhal proxy` runs with.

    Attributes:
        prefillers, decoders: The backends (`backends.parse_prefiller` / `parse_decoder`).
        order: When the decode leg is sent.
        host, port: Listen address; port 0 picks a free port (the startup line names it).
        health_interval_s: Seconds between `/health` polls of every backend.
        connect_timeout_s: Seconds to open a connection to a backend.
        prefill_timeout_s: Seconds a prefill leg may take before prefill-first gives up on it.
        shutdown_timeout_s: Seconds requests in flight get to finish after SIGTERM/SIGINT.
    """

    prefillers: tuple[Backend, ...]
    decoders: tuple[Backend, ...]
    order: Order = Order.PREFILL_FIRST
    host: str = "127.0.0.1"
    port: int = 8000
    health_interval_s: float = 2.0
    connect_timeout_s: float = 5.0
    prefill_timeout_s: float = 300.0
    shutdown_timeout_s: float = 60.0


def _unreachable(exc: BaseException) -> bool:
    """Whether a failed call says the backend is down (refused, reset, connect timeout), not
    merely slow (`prefill_timeout_s` passed)."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return True
    return isinstance(exc, (aiohttp.ClientError, OSError)) and not isinstance(
        exc, asyncio.TimeoutError)


class Proxy(Front):
    """The aiohttp application's state: pools, the client session, the health poller."""

    def __init__(self, config: ProxyConfig):
        self.config = config
        self.prefillers = Pool("prefiller", list(config.prefillers))
        self.decoders = Pool("decoder", list(config.decoders))
        self.session: aiohttp.ClientSession | None = None
        self._poller: asyncio.Task | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def _start(self, _app: web.Application) -> None:
        trace = aiohttp.TraceConfig()
        trace.on_request_chunk_sent.append(self._on_chunk_sent)
        self.session = self._client_session(trace_configs=[trace])
        await self._poll_all()
        self._poller = asyncio.create_task(self._poll_forever())

    async def _stop(self, _app: web.Application) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        if self.session is not None:
            await self.session.close()

    def describe(self, url: str) -> str:
        """The startup line: the listen address `url`, the order and every backend with its
        first health verdict."""
        return (f"kvhal proxy: listening on {url} ({self.config.order.value}); "
                f"prefillers: {', '.join(map(verdict, self.prefillers.backends))}; "
                f"decoders: {', '.join(map(verdict, self.decoders.backends))}")

    # -- health ----------------------------------------------------------------------------

    def _all(self) -> list[Backend]:
        return [*self.prefillers.backends, *self.decoders.backends]

    async def _poll(self, backend: Backend) -> None:
        timeout = aiohttp.ClientTimeout(total=max(1.0, min(5.0, self.config.health_interval_s)))
        try:
            async with self.session.get(f"{backend.url}/health", timeout=timeout) as resp:
                ok, why = resp.status == 200, f"/health answered HTTP {resp.status}"
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            ok, why = False, failure_text(exc)
        if backend.mark(ok, why):
            if ok:
                log.info("backend %s is healthy", backend.url)
            else:
                log.warning("backend %s is unhealthy: %s", backend.url, why)

    async def _poll_all(self) -> None:
        await asyncio.gather(*(self._poll(b) for b in self._all()))

    async def health(self, _request: web.Request) -> web.Response:
        """`GET /health`: every backend's state; 503 when no decoder is healthy."""
        serving = any(b.healthy is not False for b in self.decoders.backends)
        return web.json_response({
            "status": "ok" if serving else "no healthy decoder",
            "order": self.config.order.value,
            "prefillers": [b.describe() for b in self.prefillers.backends],
            "decoders": [b.describe() for b in self.decoders.backends]},
            status=200 if serving else 503)

    # -- routes ----------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.StreamResponse:
        """`GET /v1/models`: a healthy decoder's answer, passed through."""
        try:
            decoder = self.decoders.pick()
        except NoHealthyBackend as exc:
            return error_response(503, str(exc))
        return await self._relay(request, decoder, "GET", "/v1/models", None, None)

    # -- one request -----------------------------------------------------------------------

    async def _forward(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError as exc:
            return error_response(400, f"request body is not valid JSON: {exc}")
        except web.HTTPRequestEntityTooLarge:
            return error_response(413, f"request body over {MAX_BODY_BYTES} bytes")
        if (problem := body_problem(body)) is not None:
            return problem
        try:
            decoder = self.decoders.pick()
        except NoHealthyBackend as exc:
            return error_response(503, str(exc))
        headers = {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}
        request_id = secrets.token_urlsafe(REQUEST_ID_BYTES)
        try:
            prefiller = self.prefillers.pick()
        except NoHealthyBackend as exc:
            log.warning("request %s: %s; the decoder computes the whole prompt",
                        request_id[:8], exc)
            return await self._relay(request, decoder, "POST", request.path,
                                     decode_body(body, None), headers)
        rank = prefiller.next_rank()
        remote = RemotePrefill(request_id, prefiller.p2p.host, prefiller.p2p.port + rank)
        leg = self._prefill_leg(prefiller, rank, request.path,
                                prefill_body(body, request_id, chat=chat), headers)
        return await self._run_order(request, decoder, prefiller, body, remote, leg, headers)

    async def _run_order(self, request: web.Request, decoder: Backend, prefiller: Backend,
                         body: dict, remote: RemotePrefill | None, leg: Coroutine,
                         headers: dict) -> web.StreamResponse:
        """Send the prefill leg `leg` (a coroutine not started yet) and the decode leg in the
        configured order; answer with the decode leg's response."""
        order = self.config.order
        task: asyncio.Task | None = None

        def start() -> None:
            nonlocal task
            task = asyncio.create_task(leg)

        try:
            if order is Order.PREFILL_FIRST:
                start()
                status, answer = await task
                if status is not None and 400 <= status < 500:
                    self.decoders.done(decoder)
                    return web.Response(status=status, body=answer[0],
                                        headers={"Content-Type": answer[1]})
                if status is None or status >= 500:
                    remote = None
            elif order is Order.CONCURRENT:
                start()
            resp = await self._relay(request, decoder, "POST", request.path,
                                     decode_body(body, remote), headers,
                                     on_sent=start if order is Order.DECODE_FIRST else None)
            if task is not None and resp.prepared:   # unprepared: the proxy's own 502
                await task
            return resp
        finally:
            if task is None:           # decode-first whose decode leg never went out
                leg.close()
                self.prefillers.done(prefiller)
            elif not task.done():
                task.cancel()
                self.prefillers.done(prefiller)

    async def _prefill_leg(self, prefiller: Backend, rank: int, path: str, body: dict,
                           headers: dict) -> tuple[int | None, tuple[bytes, str] | None]:
        """Send one prefill leg and wait for its whole answer; returns (HTTP status, (body,
        Content-Type header)), or (None, None) when the prefiller was not reached or timed
        out. Ends the leg in the prefillers' pool when it returns; a leg cancelled (maybe
        before it ever ran) is ended by `_run_order`, which cancelled it."""
        if prefiller.dp_size > 1:
            headers = {**headers, DP_RANK_HEADER: str(rank)}
        timeout = aiohttp.ClientTimeout(total=self.config.prefill_timeout_s,
                                        sock_connect=self.config.connect_timeout_s)
        rid = body["kv_transfer_params"]["remote_decoder"]["kv_request_id"][:8]
        try:
            async with self.session.post(f"{prefiller.url}{path}", json=body, headers=headers,
                                         timeout=timeout) as resp:
                answer = await resp.read()
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            why = failure_text(exc)
            log.warning("request %s: prefill leg to %s failed: %s; the decoder recomputes",
                        rid, prefiller.url, why)
            self.prefillers.done(prefiller, why, unreachable=_unreachable(exc))
            return None, None
        if resp.status >= 500:
            log.warning("request %s: prefill leg to %s answered HTTP %d; the decoder "
                        "recomputes", rid, prefiller.url, resp.status)
        self.prefillers.done(prefiller, f"HTTP {resp.status}" if resp.status >= 500 else None)
        return resp.status, (answer, resp.headers.get("Content-Type", "application/json"))

    async def _relay(self, request: web.Request, backend: Backend, method: str, path: str,
                     body: dict | None, headers: dict | None,
                     on_sent: Callable[[], None] | None = None) -> web.StreamResponse:
        """Send one request to `backend` (picked from the decoders, ended here) and stream
        its answer to the client as it arrives. `on_sent` runs once the request is written."""
        ctx = SimpleNamespace(on_sent=on_sent)
        try:
            upstream = await self.session.request(method, f"{backend.url}{path}", json=body,
                                                  headers=headers, trace_request_ctx=ctx)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            why = failure_text(exc)
            log.warning("decoder %s unreachable: %s", backend.url, why)
            self.decoders.done(backend, why, unreachable=True)
            return error_response(502, f"decoder {backend.url} unreachable: {why}", backend.url)
        except BaseException:
            self.decoders.done(backend)
            raise
        resp = passed_through(upstream)
        error, finished = None, False
        try:
            await resp.prepare(request)
            while True:
                try:
                    chunk = await upstream.content.readany()
                except (aiohttp.ClientError, OSError) as exc:
                    error = failure_text(exc)
                    log.warning("decoder %s failed mid-answer: %s", backend.url, error)
                    if request.transport is not None:
                        request.transport.abort()   # the client sees an incomplete body
                    return resp
                if not chunk:
                    break
                await resp.write(chunk)
            finished = True
        except ConnectionResetError:    # the client left (handled here: no traceback logged)
            log.info("client left; closing the leg to decoder %s", backend.url)
            return resp
        finally:
            if finished:
                upstream.release()
            else:
                upstream.close()    # closing the connection aborts the request in vLLM
            self.decoders.done(backend, error)    # before the client can see the end
        with contextlib.suppress(ConnectionResetError):
            await resp.write_eof()
        return resp

    @staticmethod
    async def _on_chunk_sent(_session, trace_ctx, _params) -> None:
        ctx = trace_ctx.trace_request_ctx
        if ctx is not None and ctx.on_sent is not None:
            on_sent, ctx.on_sent = ctx.on_sent, None
            on_sent()
