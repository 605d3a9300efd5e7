"""HAProxy arm: the config we write, and (when installed) a live run against stub servers."""

from __future__ import annotations

import os
import shutil
import socket
from collections import Counter
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from proxy.bench.haproxy import Backend, HAProxyError, render_config, run_haproxy
from proxy.bench.runner import HttpTarget, Outcome, TargetSpec
from proxy.bench.scenario import Arrival, parse_scenario

BACKENDS = [Backend("t0", "http://127.0.0.1:8000"), Backend("t1", "http://127.0.0.1:8010")]


def test_config_leastconn():
    cfg = render_config(BACKENDS, "leastconn", 9999, maxconn=4000, server_maxconn=1000)
    assert "bind 127.0.0.1:9999" in cfg
    assert "balance leastconn" in cfg
    assert "server t0 127.0.0.1:8000 maxconn 1000" in cfg
    assert "server t1 127.0.0.1:8010 maxconn 1000" in cfg
    assert "    maxconn 4000" in cfg  # global: keeps HAProxy under the 20000 fd ceiling
    assert "mode http" in cfg
    assert "x-served-by %[srv_name]" in cfg


def test_config_random_two_choices():
    assert "balance random(2)" in render_config(BACKENDS, "random2", 1)


def test_config_session_affinity_with_bounded_load():
    cfg = render_config(BACKENDS, "session", 1)
    for line in ("balance hdr(x-session-id)", "hash-type consistent", "hash-balance-factor 150"):
        assert line in cfg


@pytest.mark.parametrize(
    ("backends", "balance"),
    [([], "leastconn"), ([Backend("x", "127.0.0.1:8000")], "leastconn"), (BACKENDS, "roundrobin")],
)
def test_config_rejects_bad_input(backends, balance):
    with pytest.raises(ValueError):
        render_config(backends, balance, 1)


def test_missing_binary_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda _name: None)
    monkeypatch.setattr("proxy.bench.haproxy.Path.exists", lambda _self: False)
    from proxy.bench.haproxy import haproxy_binary

    with pytest.raises(HAProxyError, match="apt-get install -y haproxy"):
        haproxy_binary()


needs_haproxy = pytest.mark.skipif(
    shutil.which("haproxy") is None and not os.path.exists("/usr/sbin/haproxy"),
    reason="haproxy not installed (apt-get install -y haproxy)",
)


@pytest.fixture
async def two_servers() -> AsyncIterator[list[Backend]]:
    runners, backends = [], []
    for name in ("a", "b"):

        async def infer(request: web.Request, name: str = name) -> web.Response:
            await request.read()
            return web.json_response({"served": name})

        async def ready(_request: web.Request) -> web.Response:
            return web.Response()

        app = web.Application()
        app.router.add_post("/v2/models/{model}/infer", infer)
        app.router.add_get("/v2/health/ready", ready)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        backends.append(Backend(name, f"http://127.0.0.1:{runner.addresses[0][1]}"))
    yield backends
    for r in runners:
        await r.cleanup()


@needs_haproxy
@pytest.mark.parametrize("balance", ["leastconn", "random2", "session"])
async def test_live_haproxy_forwards_and_names_the_server(two_servers, balance, tmp_path):
    sc = parse_scenario({"duration_s": 1, "classes": {"c": {"rate_rps": 1, "sessions": 4}}})
    async with run_haproxy(two_servers, balance, workdir=tmp_path) as url:
        target = HttpTarget("haproxy", TargetSpec(urls=(url,)), sc)
        try:
            results = [
                await target.send(Arrival(i, 0.0, "c", 8, f"c-{i % 2}", False)) for i in range(40)
            ]
        finally:
            await target.aclose()
    assert all(r.outcome == Outcome.OK for r in results)
    served = Counter(r.instance for r in results)
    assert set(served) <= {"a", "b"} and sum(served.values()) == 40
    if balance == "session":
        # each session id sticks to one server (bounded load is not reached at 1 in flight)
        by_session: dict[str, set[str | None]] = {}
        for i, r in enumerate(results):
            by_session.setdefault(f"c-{i % 2}", set()).add(r.instance)
        assert all(len(v) == 1 for v in by_session.values())
    assert (tmp_path / f"haproxy-{balance}.cfg").exists()


@needs_haproxy
async def test_haproxy_that_cannot_start_is_a_clear_error(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(HAProxyError, match="exited"):
            async with run_haproxy(BACKENDS, "leastconn", workdir=tmp_path, port=port):
                pass
