"""A tiny stand-in for Triton's HTTP endpoint, for fault-path tests of the real proxy.

Each server answers readiness, model config, model readiness and ``infer`` for the models it
is told to serve; tests flip its behaviour (slow, absent model, dropping connections).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from proxy.app import ProxyServer
from proxy.config import parse


@dataclass
class FakeTriton:
    name: str
    models: dict[str, dict[str, Any]] = field(default_factory=lambda: {"m": {}})
    """model name -> its JSON config"""
    delay_s: float = 0.0
    drop_next: int = 0
    """Close this many next infer connections without answering a byte."""
    infers: int = 0
    bodies: list[bytes] = field(default_factory=list)
    """Every infer body received, in order."""
    url: str = ""
    _runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/v2/health/ready", self._ready)
        app.router.add_get("/v2/models/{model}/config", self._config)
        app.router.add_get("/v2/models/{model}/ready", self._model_ready)
        app.router.add_post("/v2/models/{model}/infer", self._infer)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _ready(self, request: web.Request) -> web.Response:
        return web.Response()

    def _unknown(self, model: str) -> web.Response:
        body = {"error": f"Request for unknown model: '{model}' has no available versions"}
        return web.json_response(body, status=404)

    async def _config(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]
        if model not in self.models:
            return self._unknown(model)
        return web.json_response({"name": model, "max_batch_size": 4, **self.models[model]})

    async def _model_ready(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if request.match_info["model"] in self.models else 400)

    async def _infer(self, request: web.Request) -> web.StreamResponse:
        model = request.match_info["model"]
        body = await request.read()
        self.bodies.append(body)
        if self.drop_next > 0:
            self.drop_next -= 1
            assert request.transport is not None
            request.transport.close()  # a dead server's socket: no byte of an answer
            await asyncio.sleep(1)
        if model not in self.models:
            return self._unknown(model)
        self.infers += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return web.json_response({"model_name": model, "served_by": self.name, "bytes": len(body)})


@asynccontextmanager
async def fakes(n: int) -> AsyncIterator[list[FakeTriton]]:
    servers = [FakeTriton(f"f{i}") for i in range(n)]
    for s in servers:
        await s.start()
    try:
        yield servers
    finally:
        for s in servers:
            await s.stop()


def policy(servers: list[FakeTriton], **sections: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "instances": [{"name": s.name, "http": s.url} for s in servers],
        "listen": {"host": "127.0.0.1", "http_port": 0, "grpc_port": 0, "metrics_port": 0},
        "routing": {"policy": {"name": "round_robin"}},
    }
    doc.update(sections)
    return doc


@asynccontextmanager
async def proxy_for(doc: dict[str, Any], **kwargs: Any) -> AsyncIterator[ProxyServer]:
    server = ProxyServer(parse(json.loads(json.dumps(doc)), "<test>"), **kwargs)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
