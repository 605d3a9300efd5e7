"""The app factory: one ProxyServer per policy, every resource inside its lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc
from aiohttp import web

from proxy.aio import cancel_and_wait
from proxy.clock import Clock, MonotonicClock
from proxy.config import ProxyConfig, load_file
from proxy.frontends import admin_relay
from proxy.frontends.grpc import GrpcFrontend
from proxy.frontends.http import HttpFrontend
from proxy.frontends.http_server import HttpServer
from proxy.h2.server import H2GrpcServer
from proxy.runtime import Runtime
from proxy.scheduling import GateObserver
from proxy.strict import ConfigError
from proxy.telemetry import Telemetry, merge_workers
from proxy.workers import WorkerRole, with_ports

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BoundPorts:
    http: int
    grpc: int | None
    metrics: int | None


def _stamp(path: Path) -> tuple[float, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime, st.st_size


class ProxyServer:
    """Starts and stops the proxy's servers for one config."""

    def __init__(
        self,
        config: ProxyConfig,
        *,
        policy_path: Path | None = None,
        clock: Clock | None = None,
        rng: random.Random | None = None,
        telemetry: Telemetry | None = None,
        gate_observer: GateObserver | None = None,
        is_leader: Callable[[], bool] = lambda: True,
        watch_interval_s: float = 1.0,
        policy_loader: Callable[[Path], ProxyConfig] = load_file,
        role: WorkerRole | None = None,
    ) -> None:
        self.config = config
        self.role = role
        """One of several worker processes on the same ports (``serve --workers``), or None."""
        self.policy_path = policy_path
        self.clock = clock or MonotonicClock()
        self.rng = rng or random.Random()
        self.telemetry = telemetry or Telemetry()
        self.gate_observer = gate_observer
        self.runtime = Runtime(
            config,
            self.clock,
            self.rng,
            self.telemetry,
            gate_observer=gate_observer,
            is_leader=is_leader,
            role=role,
        )
        self.telemetry.watch(self.current)
        self._http_server: HttpServer | None = None
        self._metrics_runner: web.AppRunner | None = None
        self._grpc_server: grpc.aio.Server | H2GrpcServer | None = None
        self._admin_endpoint: admin_relay.LeaderEndpoint | None = None
        self.ports: BoundPorts | None = None
        self.watch_interval_s = watch_interval_s
        self.policy_loader = policy_loader
        self._reload_wanted = asyncio.Event()
        self._watch_task: asyncio.Task[None] | None = None
        self._lag_task: asyncio.Task[None] | None = None
        self._unwatch_gc: Callable[[], None] | None = None

    def request_reload(self) -> None:
        """Re-read the policy file soon (SIGHUP handler; safe to call from a signal)."""
        self._reload_wanted.set()

    async def reload(self) -> bool:
        """Re-read the policy file and apply it; a bad file keeps the running policy."""
        if self.policy_path is None:
            log.warning("reload requested, but the proxy was not started from a policy file")
            return False
        try:
            config = self.policy_loader(self.policy_path)
            if self.role is not None:
                config = self._ports_chosen_for_workers(config)
            restart_only = await self.runtime.apply(config)
        except (ConfigError, ValueError) as exc:
            self.telemetry.reloads.labels("error").inc()
            log.error("policy reload failed, keeping the running policy: %s", exc)
            return False
        except Exception:
            # A bug, not a bad file: say so with the traceback; the proxy keeps serving.
            self.telemetry.reloads.labels("error").inc()
            log.exception("policy reload failed unexpectedly, keeping the running policy")
            return False
        self.config = config
        self.telemetry.reloads.labels("ok").inc()
        log.info("policy reloaded from %s", self.policy_path)
        if restart_only:
            log.warning("changed sections that need a restart: %s", ", ".join(restart_only))
        return True

    def _ports_chosen_for_workers(self, config: ProxyConfig) -> ProxyConfig:
        """A port the file leaves at 0 is the one the supervisor picked for every worker."""
        listen, running = config.listen, self.config.listen
        http = running.http_port if listen.http_port == 0 else listen.http_port
        grpc_port = running.grpc_port if listen.grpc_port == 0 else listen.grpc_port
        return with_ports(config, http, grpc_port)

    async def _watch_policy(self) -> None:
        """Reload on SIGHUP or when the policy file changes on disk."""
        assert self.policy_path is not None
        seen = _stamp(self.policy_path)
        while True:
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._reload_wanted.wait(), self.watch_interval_s)
                stamp = _stamp(self.policy_path)
                if self._reload_wanted.is_set() or stamp != seen:
                    self._reload_wanted.clear()
                    seen = stamp
                    await self.reload()
            except Exception:
                # The watch must outlive anything one round meets.
                log.exception("policy watch: unexpected error; watching on")
                await asyncio.sleep(self.watch_interval_s)

    def current(self) -> Runtime:
        return self.runtime

    async def start(self) -> BoundPorts:
        serves_grpc = self._serves_grpc()
        await self.runtime.start()
        listen = self.config.listen
        http_frontend = HttpFrontend(self.current)
        self._http_server = HttpServer(http_frontend)
        http_port = await self._http_server.start(
            listen.host, listen.http_port, reuse_port=self.role is not None, backlog=listen.backlog
        )
        self._metrics_runner, metrics_port = await self._start_metrics()
        grpc_frontend = GrpcFrontend(self.current) if serves_grpc else None
        grpc_port = await self._start_grpc(grpc_frontend) if grpc_frontend else None
        await self._start_admin_relay(http_frontend, grpc_frontend)
        self.ports = BoundPorts(http=http_port, grpc=grpc_port, metrics=metrics_port)
        if self.role is not None:
            # Tells the supervisor this worker serves, and the leader where to read its metrics.
            info = {"pid": os.getpid(), "metrics_port": metrics_port}
            self.role.ready_file().write_text(json.dumps(info))
        if self.policy_path is not None:
            self._watch_task = asyncio.create_task(self._watch_policy(), name="policy-watch")
        self._lag_task = asyncio.create_task(
            self.telemetry.watch_loop_lag(lambda lag: self.current().observe_lag(lag)),
            name="loop-lag",
        )
        self._unwatch_gc = self.telemetry.watch_gc()
        return self.ports

    def _serves_grpc(self) -> bool:
        """gRPC is served when the instances have gRPC addresses: all of them, or it is off."""
        without = [i.name for i in self.config.instances if i.grpc is None]
        if without and len(without) < len(self.config.instances):
            raise ValueError(
                f"instances {', '.join(without)} have no gRPC address: set instances[].grpc "
                "on every instance (or on none, to serve HTTP only)"
            )
        if without:
            log.info("no instance has a gRPC address (instances[].grpc): gRPC frontend off")
        return not without

    async def _start_admin_relay(self, http: HttpFrontend, grpc: GrpcFrontend | None) -> None:
        """With several workers, model control is fanned out by the leader alone: it serves
        the relay socket, the followers send their calls there (proxy.frontends.admin_relay)."""
        if self.role is None or self.role.count <= 1:
            return
        path = admin_relay.socket_path(self.role.state_dir)
        if self.role.leader:
            self._admin_endpoint = admin_relay.LeaderEndpoint(
                http.fan_out, grpc.fan_out if grpc is not None else None
            )
            await self._admin_endpoint.start(path, self.config.limits.max_body_bytes)
        else:
            self.runtime.admin_leader = admin_relay.LeaderClient(path)

    async def _start_grpc(self, frontend: GrpcFrontend) -> int:
        listen = self.config.listen
        if listen.grpc_engine == "h2":
            h2 = frontend.h2_server(self.config.limits.max_body_bytes)
            bound = await h2.start(
                listen.host,
                listen.grpc_port,
                reuse_port=self.role is not None,
                backlog=listen.backlog,
            )
            self._grpc_server = h2
            return bound
        server = frontend.server(
            self.config.limits.max_body_bytes, reuse_port=self.role is not None
        )
        host = f"[{listen.host}]" if ":" in listen.host else listen.host
        port: int = server.add_insecure_port(f"{host}:{listen.grpc_port}")
        await server.start()
        self._grpc_server = server
        return port

    async def _start_metrics(self) -> tuple[web.AppRunner, int]:
        async def metrics(request: web.Request) -> web.Response:
            if self.role is not None and self.role.leader:
                return web.Response(
                    body=await self._all_workers_metrics(), content_type="text/plain"
                )
            return web.Response(body=self.telemetry.exposition(), content_type="text/plain")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        listen = self.config.listen
        host, port = listen.host, listen.metrics_port
        if self.role is not None and not self.role.leader:
            # Only the leader serves the metrics port; it reads the others here.
            host, port = "127.0.0.1", 0
        await web.TCPSite(runner, host, port, reuse_address=True).start()
        return runner, runner.addresses[0][1]

    async def _all_workers_metrics(self) -> bytes:
        """The leader's metrics and every follower's, each series labelled with its worker."""
        assert self.role is not None
        texts = [("0", self.telemetry.exposition().decode())]
        timeout = aiohttp.ClientTimeout(total=2.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for index in range(1, self.role.count):
                try:
                    info = json.loads(self.role.ready_file(index).read_text())
                    url = f"http://127.0.0.1:{int(info['metrics_port'])}/metrics"
                    async with session.get(url) as resp:
                        texts.append((str(index), await resp.text()))
                except (OSError, ValueError, KeyError, aiohttp.ClientError, TimeoutError) as exc:
                    # A worker being restarted has no metrics for a moment: say so, go on.
                    log.warning("metrics of worker %d unavailable: %s", index, exc)
        return merge_workers(texts)

    async def stop(self) -> None:
        """Shut down without losing what was accepted.

        Readiness turns false and the listeners close first (no new connection or call; idle
        keep-alive connections close). Queued and in-flight requests then get up to
        ``limits.drain_timeout_s`` to finish; requests still queued at the deadline get 503 /
        UNAVAILABLE, and the in-flight ones left are cancelled.
        """
        await cancel_and_wait(self._watch_task, self._lag_task)
        self._watch_task = self._lag_task = None
        if self._unwatch_gc is not None:
            self._unwatch_gc()
            self._unwatch_gc = None
        rt = self.runtime
        rt.draining = True
        drain_s = self.config.limits.drain_timeout_s
        grpc_stopped = None
        if self._grpc_server is not None:
            # Refuses new calls at once, cancels those still running after the grace.
            grpc_stopped = asyncio.create_task(self._grpc_server.stop(drain_s + 1.0))
            self._grpc_server = None
        if self._http_server is not None:
            self._http_server.stop_listening()
        deadline = self.clock.now() + drain_s
        while self._unfinished() and self.clock.now() < deadline:
            await asyncio.sleep(0.05)
        if self._unfinished():
            log.warning(
                "drain timeout (%g s): %d requests still queued get 503, %d in flight are "
                "cancelled",
                drain_s,
                rt.gates.queued_total() if rt.gates else 0,
                rt.fleet.total_in_flight(),
            )
        if rt.gates is not None:
            rt.gates.close()  # what is still queued gets 503 now
        if self._http_server is not None:
            # Drained above: this only covers writing the last answers, then cuts the rest.
            await self._http_server.close(timeout_s=1.0)
            self._http_server = None
        if grpc_stopped is not None:
            await grpc_stopped
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
            self._metrics_runner = None
        if self._admin_endpoint is not None:
            await self._admin_endpoint.stop()
            self._admin_endpoint = None
        if rt.admin_leader is not None:
            await rt.admin_leader.close()
        await rt.stop()

    def _unfinished(self) -> int:
        rt = self.runtime
        return rt.fleet.total_in_flight() + (rt.gates.queued_total() if rt.gates else 0)

    async def __aenter__(self) -> ProxyServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
