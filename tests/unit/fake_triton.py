"""A small fake Triton (HTTP only) for tests of the proxy's own behaviour: ready, model config,
infer (optionally held until released), model load, metrics; it counts what it was asked."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator

from aiohttp import web


class FakeTriton:
    """Enough of Triton's HTTP API for the proxy: ready, model config, infer, metrics."""

    def __init__(self, name: str = "t") -> None:
        self.name = name
        self.hits: Counter[str] = Counter()
        self.sessions: list[str] = []
        """``x-session-id`` of every infer request, in order."""
        self.hold: asyncio.Event | None = None
        """When set to an unset Event, infer requests wait for it."""
        self.infer_status = 200
        """The status infer requests are answered with."""
        self.infer_sizes: list[tuple[int, str | None]] = []
        """Body length and ``Inference-Header-Content-Length`` of every infer request."""

    def app(self) -> web.Application:
        async def ready(request: web.Request) -> web.Response:
            return web.Response()

        async def config(request: web.Request) -> web.Response:
            return web.json_response({"max_batch_size": 8, "dynamic_batching": {}})

        async def infer(request: web.Request) -> web.Response:
            body = await request.read()
            self.hits["infer"] += 1
            self.sessions.append(request.headers.get("x-session-id", ""))
            self.infer_sizes.append(
                (len(body), request.headers.get("Inference-Header-Content-Length"))
            )
            if self.hold is not None:
                await self.hold.wait()
            return web.json_response({"outputs": []}, status=self.infer_status)

        async def load(request: web.Request) -> web.Response:
            await request.read()
            self.hits["load"] += 1
            if "authorization" in request.headers:
                self.hits["credential leaked"] += 1
            return web.json_response({})

        async def metrics(request: web.Request) -> web.Response:
            self.hits["metrics"] += 1
            return web.Response(
                text='nv_inference_pending_request_count{model="m",version="1"} 0\n'
            )

        app = web.Application()
        app.router.add_get("/v2/health/ready", ready)
        app.router.add_get("/v2/models/{model}/config", config)
        app.router.add_post("/v2/models/{model}/infer", infer)
        app.router.add_post("/v2/repository/models/{model}/load", load)
        app.router.add_get("/metrics", metrics)
        return app


@contextlib.asynccontextmanager
async def fake_triton(name: str = "t") -> AsyncIterator[tuple[FakeTriton, str]]:
    fake = FakeTriton(name)
    runner = web.AppRunner(fake.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield fake, f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
