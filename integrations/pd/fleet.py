"""`kvhal proxy --route POLICY --instance SPEC ...`: one router in front of N equal vLLM
instances (aiohttp), steering each request by where its KV lives (`route.py`).

Routes:
    POST /v1/completions, /v1/chat/completions: the request goes to the instance the router
        chooses (its body unchanged, except kv-p2p's `kv_transfer_params.remote_kv_source`);
        the answer is passed through: status, content type, body bytes, streamed (SSE) chunks
        written as they arrive.
    GET /v1/models: a healthy instance's answer, passed through.
    GET /health: 200 with every instance's state while one is healthy, else 503.
    GET /router/stats: per instance: health, in flight, load, requests routed by reason,
        predicted hit tokens per tier, index blocks per tier, its event stream's counters.

Background: every `health_interval_s`, each instance's `/health` and `/metrics`
(`vllm:num_requests_running` + `vllm:num_requests_waiting`, the router's load view of
requests it did not send) are polled, and silent event streams checked; one asyncio task per
instance subscribes to its events (`events_sub.EventFeed`).

Faults, each with a log line naming the instance, never a crash or a hung request:
    - an instance not reached (refused, reset, connect timeout) or answering 5xx before any
      byte reached the client: marked unhealthy, its index dropped, and the request sent to
      the next choice among the others (each instance tried once); the last answer or a 502
      when all failed. Health polls bring it back when `/health` answers 200 again.
    - an instance that accepts the request but sends no byte of its answer (status line,
      headers and first body chunk) within `first_byte_timeout_s` (frozen, hung): marked
      unhealthy, its index dropped, and the request sent once more, to the next choice among
      the others; a 504 naming it when no other is left or the request was re-sent once
      already. The client's response starts only with the instance's first body chunk, so
      nothing has reached the client before that deadline.
    - an instance failing mid-answer (an error, or `first_byte_timeout_s` without a byte
      between two chunks): the client's response ends without its terminating chunk (an
      incomplete body, never a clean truncated answer), never re-sent; it is marked unhealthy.
    - no healthy instance: 503 naming each and why.
    - event-stream faults: `events_sub`; tokenizer faults: `prompts`.
400 for a body that is not a JSON object (or whose `kv_transfer_params` is not one), 413 over
`MAX_BODY_BYTES`, as in P/D mode. Bodies are decoded with msgspec and sent on as the client's
bytes unless kv-p2p adds `remote_kv_source` (then encoded with msgspec): a 50 MB token-id
prompt holds the event loop ~0.25 s on this VM instead of ~1 s with the standard library.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from dataclasses import dataclass

import aiohttp
import msgspec
import zmq.asyncio
from aiohttp import web

from .backends import FIRST_BYTE_TIMEOUT_S, Backend, NoHealthyBackend, Pool
from .events_sub import EventFeed
from .front import (FORWARDED_HEADERS, MAX_BODY_BYTES, Front, body_problem, error_response,
                    failure_text, passed_through, verdict)
from .legs import client_params
from .prompts import Prompts
from .route import Decision, Instance, InstanceSpec, Router, conversation_of

log = logging.getLogger("kvhal.proxy")

#: The queue gauges read from an instance's `/metrics` (summed over their label sets).
_QUEUE = re.compile(rb"^vllm:num_requests_(?:running|waiting)(?:\{[^}]*\})? (\S+)", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """Everything fleet mode runs with.

    Attributes:
        instances: The `--instance` specs.
        policy: The `--route` policy (`route.POLICIES`).
        tokenizer: `--tokenizer` folder, or None.
        host, port: Listen address; port 0 picks a free port.
        health_interval_s: Seconds between polls of each instance's `/health` and `/metrics`.
        connect_timeout_s: Seconds to connect to an instance.
        first_byte_timeout_s: Seconds from sending a request to an instance until its first
            body byte (then the request is re-sent elsewhere, module docstring), and the most
            seconds between two chunks of an answer.
        shutdown_timeout_s: Seconds requests in flight get to finish on SIGTERM/SIGINT.
        load_tokens, p2p_busy, p2p_min_tokens: The router's knobs (`route.Router`).
        replay_timeout_s, silence_s: The event feeds' knobs (`events_sub.EventFeed`).
    """

    instances: tuple[InstanceSpec, ...]
    policy: str = "kv"
    tokenizer: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    health_interval_s: float = 2.0
    connect_timeout_s: float = 5.0
    shutdown_timeout_s: float = 60.0
    load_tokens: int = 128
    p2p_busy: int = 2
    p2p_min_tokens: int = 256
    replay_timeout_s: float = 2.0
    silence_s: float = 10.0
    first_byte_timeout_s: float = FIRST_BYTE_TIMEOUT_S


def parse_queue(text: bytes) -> int:
    """Running + waiting requests in a vLLM `/metrics` answer (0 when it has neither)."""
    return int(sum(float(v) for v in _QUEUE.findall(text)))


class Fleet(Front):
    """The aiohttp application's state: router, client session, pollers and event feeds."""

    def __init__(self, config: FleetConfig):
        self.config = config
        instances = []
        for spec in config.instances:
            inst = Instance(spec, Backend(spec.url))
            if spec.events is not None:
                inst.feed = EventFeed(spec.url, spec.events, spec.replay, inst.index,
                                      config.replay_timeout_s, config.silence_s)
            instances.append(inst)
        self.router = Router(instances, config.policy, load_tokens=config.load_tokens,
                             p2p_busy=config.p2p_busy, p2p_min_tokens=config.p2p_min_tokens)
        self.prompts = Prompts(config.tokenizer)
        self.session: aiohttp.ClientSession | None = None
        self._zmq: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task] = []

    # -- lifecycle -------------------------------------------------------------------------

    def _routes(self) -> list[tuple[str, object]]:
        return [("/router/stats", self.stats)]

    async def _start(self, _app: web.Application) -> None:
        self.session = self._client_session()
        self._zmq = zmq.asyncio.Context()
        self._tasks = [asyncio.create_task(i.feed.run(self._zmq), name=f"events {i.spec.url}")
                       for i in self.router.instances if i.feed is not None]
        await self._poll_all()
        self._tasks.append(asyncio.create_task(self._poll_forever()))

    async def _stop(self, _app: web.Application) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.session is not None:
            await self.session.close()
        if self._zmq is not None:
            self._zmq.term()

    def describe(self, url: str) -> str:
        """The startup line: the listen address `url`, the policy and every instance with its
        first health verdict."""
        return (f"kvhal proxy: listening on {url} (route {self.config.policy}); instances: "
                f"{', '.join(verdict(i.backend) for i in self.router.instances)}")

    # -- health and load -------------------------------------------------------------------

    def _unhealthy(self, inst: Instance, why: str) -> None:
        """Mark `inst` down (routed around) and drop its index."""
        if inst.backend.mark(False, why):
            log.warning("instance %s is unhealthy (%s): routed around, its index dropped",
                        inst.spec.url, why)
        inst.queued = 0
        if inst.feed is not None:
            if inst.feed.stats.state != "down":
                inst.feed.drop(why)
        else:
            inst.index.clear()

    async def _poll(self, inst: Instance) -> None:
        timeout = aiohttp.ClientTimeout(total=max(1.0, min(5.0, self.config.health_interval_s)))
        try:
            async with self.session.get(f"{inst.spec.url}/health", timeout=timeout) as resp:
                ok, why = resp.status == 200, f"/health answered HTTP {resp.status}"
            if ok:
                async with self.session.get(f"{inst.spec.url}/metrics",
                                            timeout=timeout) as resp:
                    if resp.status == 200:
                        inst.queued = parse_queue(await resp.read())
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            ok, why = False, failure_text(exc)
        if not ok:
            self._unhealthy(inst, why)
        elif inst.backend.mark(True):
            log.info("instance %s is healthy", inst.spec.url)
        if inst.feed is not None and ok:
            inst.feed.check_silence()

    async def _poll_all(self) -> None:
        await asyncio.gather(*(self._poll(i) for i in self.router.instances))

    async def health(self, _request: web.Request) -> web.Response:
        """`GET /health`: every instance's state; 503 when none is healthy."""
        serving = any(i.backend.healthy is not False for i in self.router.instances)
        return web.json_response({
            "status": "ok" if serving else "no healthy instance",
            "route": self.config.policy,
            "instances": [i.backend.describe() for i in self.router.instances]},
            status=200 if serving else 503)

    async def stats(self, _request: web.Request) -> web.Response:
        """`GET /router/stats` (module docstring)."""
        instances = [i.describe() for i in self.router.instances]
        return web.json_response({
            "route": self.config.policy,
            "tokenizer": self.prompts.problem or "loaded",
            "requests": sum(i["routed"] for i in instances),
            "instances": instances})

    # -- routes ----------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.StreamResponse:
        """`GET /v1/models`: a healthy instance's answer, passed through."""
        try:
            inst = self.router.live()[0]
        except NoHealthyBackend as exc:
            return error_response(503, str(exc))
        inst.backend.outstanding += 1
        resp, _ = await self._relay(request, inst, "GET", "/v1/models", None, None,
                                    last=True, resend_slow=False)
        return resp

    async def _forward(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            raw = await request.read()
            body = msgspec.json.decode(raw)
        except web.HTTPRequestEntityTooLarge:
            return error_response(413, f"request body over {MAX_BODY_BYTES} bytes")
        except msgspec.DecodeError as exc:
            return error_response(400, f"request body is not JSON: {exc}")
        if (problem := body_problem(body)) is not None:
            return problem
        tokens = self.prompts.tokens(body, chat=chat)
        conversation = conversation_of(body, tokens)
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        headers = {k: request.headers[k] for k in FORWARDED_HEADERS if k in request.headers}
        path = "/v1/chat/completions" if chat else "/v1/completions"
        tried: tuple[Instance, ...] = ()
        resent_slow = False     # re-sent once already after a first-byte timeout
        while True:
            try:
                decision = self.router.choose(tokens, conversation, exclude=tried,
                                              cache_salt=salt)
            except NoHealthyBackend as exc:
                return error_response(503, str(exc))
            tried += (decision.instance,)
            feed = decision.instance.feed
            batches_before = None if feed is None else feed.stats.batches
            last = len(tried) == len(self.router.instances) or not any(
                i.backend.healthy is not False for i in self.router.instances
                if i not in tried)
            try:
                resp, served = await self._relay(request, decision.instance, "POST", path,
                                                 _payload(raw, body, decision), headers,
                                                 last=last, resend_slow=not resent_slow)
            except _TryAnother as retry:
                resent_slow = resent_slow or retry.slow
                continue
            finally:
                self.router.finished(decision)
            if served and decision.expects_store and feed is not None:
                feed.expect_batch(batches_before)
            return resp

    async def _relay(self, request: web.Request, inst: Instance, method: str, path: str,
                     body: bytes | None, headers: dict | None, *, last: bool,
                     resend_slow: bool) -> tuple[web.StreamResponse, bool]:
        """Send one request to `inst` (counted in its `outstanding`, ended here) with `body`,
        JSON bytes or None, and stream its answer to the client, which gets nothing before
        the answer's first body chunk.
        Returns (response, whether it was a complete 2xx answer).

        Raises:
            _TryAnother: another instance should be tried: `inst` was not reached, answered
                5xx or failed before its first body chunk and `last` is False, or sent
                nothing within `first_byte_timeout_s` and `resend_slow` and not `last`.
        """
        backend, url = inst.backend, inst.spec.url
        limit = self.config.first_byte_timeout_s
        upstream = None
        try:
            async with asyncio.timeout(limit) as first_byte:
                if body is not None:
                    headers = {**(headers or {}), "Content-Type": "application/json"}
                upstream = await self.session.request(method, f"{url}{path}", data=body,
                                                      headers=headers)
                if upstream.status >= 500 and not last:
                    upstream.close()
                    Pool.done(backend, f"HTTP {upstream.status}")
                    self._unhealthy(inst, f"answered HTTP {upstream.status}")
                    log.warning("request sent on from %s (HTTP %d) to another instance",
                                url, upstream.status)
                    raise _TryAnother(slow=False)
                first = await upstream.content.readany()
        except TimeoutError as exc:
            if upstream is not None:
                upstream.close()    # closing the connection aborts the request in vLLM
            if not first_byte.expired():     # aiohttp's connect timeout: not reached
                return self._not_reached(inst, exc, last)
            why = f"no byte of its answer within {limit:g} s (--first-byte-timeout-s)"
            Pool.done(backend, why)
            self._unhealthy(inst, why)
            if resend_slow and not last:
                log.warning("request re-sent from %s (%s) to another instance", url, why)
                raise _TryAnother(slow=True) from None
            return error_response(504, f"instance {url} sent {why}", url), False
        except (aiohttp.ClientError, OSError) as exc:
            if upstream is not None:
                upstream.close()
            return self._not_reached(inst, exc, last)
        except _TryAnother:
            raise
        except BaseException:
            if upstream is not None:
                upstream.close()
            Pool.done(backend)
            raise
        resp = passed_through(upstream)
        error, finished, chunk = None, False, first
        try:
            await resp.prepare(request)
            while chunk:
                await resp.write(chunk)
                try:
                    async with asyncio.timeout(limit):
                        chunk = await upstream.content.readany()
                except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                    error = (f"no byte for {limit:g} s" if isinstance(
                        exc, TimeoutError) else failure_text(exc))
                    self._unhealthy(inst, f"failed mid-answer: {error}")
                    if request.transport is not None:
                        request.transport.abort()   # the client sees an incomplete body
                    return resp, False
            finished = True
        except ConnectionResetError:    # the client left
            log.info("client left; closing its request to %s", url)
            return resp, False
        finally:
            if finished:
                upstream.release()
            else:
                upstream.close()    # closing the connection aborts the request in vLLM
            Pool.done(backend, error or (f"HTTP {upstream.status}"
                                         if upstream.status >= 500 else None))
        with contextlib.suppress(ConnectionResetError):
            await resp.write_eof()
        return resp, upstream.status < 300

    def _not_reached(self, inst: Instance, exc: BaseException, last: bool
                     ) -> tuple[web.StreamResponse, bool]:
        """`inst` failed before its first body byte (refused, reset, connect timeout): mark
        it unhealthy; a 502 when `last`.

        Raises:
            _TryAnother: not `last`.
        """
        why = failure_text(exc)
        Pool.done(inst.backend, why)
        self._unhealthy(inst, f"unreachable: {why}")
        if not last:
            raise _TryAnother(slow=False)
        return error_response(502, f"instance {inst.spec.url} unreachable: {why}", inst.spec.url), False


class _TryAnother(Exception):
    """`Fleet._relay`: send the request to another instance; `slow`: after a first-byte
    timeout (re-sent once at most)."""

    def __init__(self, *, slow: bool):
        super().__init__()
        self.slow = slow


def _payload(raw: bytes, body: dict, decision: Decision) -> bytes:
    """The JSON bytes sent to the instance: the client's `raw` bytes, or its `body` plus
    kv-p2p's `remote_kv_source` (the client's own `kv_transfer_params` keys kept)."""
    if decision.kv_transfer is None:
        return raw
    params = client_params(body) | decision.kv_transfer
    return msgspec.json.encode(body | {"kv_transfer_params": params})
