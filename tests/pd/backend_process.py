"""A tiny HTTP backend in its own process, so a test can freeze it with SIGSTOP (a recording
backend shares the test's process). Run as `python backend_process.py NAME`; prints
`listening on http://127.0.0.1:PORT`, then serves until killed:

- `GET /health`: 200 `{}`; `GET /v1/models`: `{"backend": NAME}`.
- `POST /v1/...`: `{"backend": NAME, "echo": body}`; with `"stream": true`, SSE events
  `data: {"backend": NAME, "n": i}` for i in 0..`body["events"]` - 1 (default 3), one every
  `body["interval_s"]` seconds (default 0.05), then `data: [DONE]`.
It answers like no vLLM does (a fixed echo), never pretending to be one.
"""
from __future__ import annotations

import asyncio
import json
import sys

from aiohttp import web


def main(name: str) -> None:
    async def health(_request: web.Request) -> web.Response:
        return web.json_response({})

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"backend": name})

    async def post(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"backend": name, "echo": body})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(int(body.get("events", 3))):
            if i:
                await asyncio.sleep(float(body.get("interval_s", 0.05)))
            await resp.write(f"data: {json.dumps({'backend': name, 'n': i})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def serve() -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/{tail:.*}", post)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        print(f"listening on http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main(sys.argv[1])
