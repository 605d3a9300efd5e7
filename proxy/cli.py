"""``triton-proxy``: run the proxy, a local fleet behind it, or the benchmark."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from proxy import collector
from proxy import config as config_mod
from proxy.app import BoundPorts, ProxyServer
from proxy.strict import ConfigError
from proxy.workers import Supervisor, WorkerRole

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_REPOSITORY = ROOT / "model_repository"
DEFAULT_MODELS = (
    "simple",
    "text_encoder",
    "accel_sim",
    "text_generator",
    "accumulator",
    "sleeper",
)
log = logging.getLogger("triton_proxy")


async def _serve(server: ProxyServer, banner: str = "", *, quiet: bool = False) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    with contextlib.suppress(AttributeError):  # SIGHUP is POSIX-only
        loop.add_signal_handler(signal.SIGHUP, server.request_reload)
    ports = await server.start()
    # Measured in the issue 10 benchmark at 2x load, where the event loop lagged 30-140 ms
    # with a thousand requests queued (docs/benchmarks.md).
    collector.settle()
    try:
        if not quiet:  # a worker: its supervisor prints one banner for all of them
            print(_endpoints(ports) + banner, flush=True)
        await stop.wait()
        if not quiet:
            print("triton-proxy: stopping (draining in-flight requests)...", flush=True)
    finally:
        await server.stop()


def _endpoints(ports: BoundPorts) -> str:
    lines = [f"triton-proxy ready: HTTP localhost:{ports.http}"]
    if ports.grpc:
        lines.append(f"  gRPC localhost:{ports.grpc}")
    if ports.metrics:
        lines.append(f"  metrics http://localhost:{ports.metrics}/metrics")
    return "\n".join(lines)


def _run(coro: Any) -> None:
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:
        asyncio.run(coro)


def _serve_workers(
    count: int,
    config: config_mod.ProxyConfig,
    make: Callable[[config_mod.ProxyConfig, WorkerRole | None], ProxyServer],
    banner: str = "",
) -> int:
    """One proxy in this process, or ``count`` worker processes on the same ports."""
    if count == 1:
        _run(_serve(make(config, None), banner))
        return 0

    def worker(role: WorkerRole, cfg: config_mod.ProxyConfig) -> int:
        _run(_serve(make(cfg, role), quiet=True))
        return 0

    def ready(ports: Mapping[str, int]) -> str:
        bound = BoundPorts(
            http=ports["http"],
            grpc=ports["grpc"] if any(i.grpc for i in config.instances) else None,
            metrics=ports.get("metrics") or None,
        )
        return _endpoints(bound) + f"\n  {count} worker processes (SO_REUSEPORT)" + banner

    return Supervisor(count, config, worker).run(ready)


def cmd_serve(args: argparse.Namespace) -> int:
    cfg = config_mod.load_file(args.policy)
    path = Path(args.policy)
    return _serve_workers(
        args.workers, cfg, lambda c, role: ProxyServer(c, policy_path=path, role=role)
    )


def cmd_check(args: argparse.Namespace) -> int:
    cfg = config_mod.load_file(args.policy)
    print(f"{args.policy}: OK ({len(cfg.instances)} instances)")
    return 0


def local_policy(
    servers: Sequence[Any], base: dict[str, Any], ports: tuple[int, int, int]
) -> dict[str, Any]:
    """A policy document naming ``servers`` (LocalFleet's), on top of ``base``."""
    doc = dict(base)
    doc["instances"] = [
        {"name": s.name, "http": s.http_url, "grpc": s.grpc_address, "metrics": s.metrics_url}
        for s in servers
    ]
    listen = dict(doc.get("listen") or {})
    listen.update(http_port=ports[0], grpc_port=ports[1], metrics_port=ports[2])
    doc["listen"] = listen
    return doc


def _policy_without_instances(path: Path | None) -> dict[str, Any]:
    """A policy file's sections for ``up``: its instances are replaced by the local servers."""
    if path is None:
        return {}
    doc = config_mod.read_document(path) or {}
    if not isinstance(doc, dict):
        raise ConfigError("", "the policy file must be a mapping", str(path))
    doc.pop("instances", None)
    return doc


def cmd_up(args: argparse.Namespace) -> int:
    from proxy.local import LocalFleet, sigterm_raises_exit

    policy_path = Path(args.policy) if args.policy else None
    _policy_without_instances(policy_path)  # fail on a bad file before starting servers
    log_dir = Path(args.log_dir)
    models = args.models.split(",") if args.models else list(DEFAULT_MODELS)
    print(
        f"starting {args.instances} Triton servers ({', '.join(models)}); logs in {log_dir}",
        flush=True,
    )
    ports = (args.http_port, args.grpc_port, args.metrics_port)
    with (
        sigterm_raises_exit(),
        LocalFleet(args.instances, Path(args.model_repository), models, log_dir) as fleet,
    ):
        servers = fleet.start()
        for s in servers:
            print(f"  {s.name}: HTTP {s.http_url}  gRPC {s.grpc_address}  (log {s.log_path})")

        def load(path: Path | None) -> config_mod.ProxyConfig:
            doc = local_policy(servers, _policy_without_instances(path), ports)
            return config_mod.parse(doc, str(path) if path else "<up>")

        example = (
            f"\nTry: curl -s localhost:{args.http_port}/v2/models/simple/infer -d "
            '\'{"inputs":[{"name":"INPUT0","shape":[1,16],"datatype":"INT32",'
            '"data":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16]},{"name":"INPUT1",'
            '"shape":[1,16],"datatype":"INT32","data":[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1]}]}\''
            f"\nPoint tritonclient at localhost:{args.http_port} (HTTP) or "
            f"localhost:{args.grpc_port} (gRPC). Ctrl-C stops everything."
        )
        return _serve_workers(
            args.workers,
            load(policy_path),
            lambda c, role: ProxyServer(c, policy_path=policy_path, policy_loader=load, role=role),
            example,
        )


WORKERS_HELP = "proxy processes sharing the ports (SO_REUSEPORT; default 1); see docs/scaling.md"


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="triton-proxy", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the proxy in front of the Triton servers a policy names")
    s.add_argument("--policy", required=True, help="policy YAML file (see policies/)")
    s.add_argument("--workers", type=_positive, default=1, help=WORKERS_HELP)
    s.set_defaults(func=cmd_serve)

    c = sub.add_parser("check", help="validate a policy file and exit")
    c.add_argument("--policy", required=True)
    c.set_defaults(func=cmd_check)

    u = sub.add_parser("up", help="start local Triton servers and the proxy in front of them")
    u.add_argument("--instances", type=int, default=3)
    u.add_argument("--models", default="", help=f"comma list (default: {','.join(DEFAULT_MODELS)})")
    u.add_argument("--model-repository", default=str(DEFAULT_REPOSITORY))
    u.add_argument("--policy", default="", help="policy file whose non-instance sections to use")
    u.add_argument("--log-dir", default=str(ROOT / "runs" / "logs"))
    u.add_argument("--http-port", type=int, default=8000)
    u.add_argument("--grpc-port", type=int, default=8001)
    u.add_argument("--metrics-port", type=int, default=8002)
    u.add_argument("--workers", type=_positive, default=1, help=WORKERS_HELP)
    u.set_defaults(func=cmd_up)

    from proxy.ops.canary_report import add_parser as add_canary

    add_canary(sub)

    try:
        from proxy.bench.cli import add_parser as add_bench
    except ImportError:
        pass
    else:
        add_bench(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"triton-proxy: invalid policy: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
