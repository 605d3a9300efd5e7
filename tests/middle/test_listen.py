"""The proxy's HTTP listener as the kernel sees it."""

from __future__ import annotations

import subprocess

from tests.middle.conftest import ProxyFactory, port_of


def listen_queue_limit(port: int) -> int:
    """The accept-queue limit of the socket listening on ``port`` (``ss``: for a listening
    socket, Send-Q is the backlog the kernel granted)."""
    out = subprocess.run(
        ["ss", "-Hltn", f"sport = :{port}"], check=True, capture_output=True, text=True
    ).stdout
    rows = [line.split() for line in out.splitlines() if line.strip()]
    assert rows, f"nothing listens on {port}: {out!r}"
    return int(rows[0][2])


def test_the_listen_queues_are_the_configured_backlog(proxy_on: ProxyFactory) -> None:
    # aiohttp's default of 128 overflowed under many simultaneous clients (TcpExtListenOverflows):
    # every overflow cost a client a SYN retransmission of 1 s or more. The gRPC port's was
    # loop.create_server's 100 until session 49.
    with proxy_on({"listen": {"backlog": 1000}}) as proxy:
        assert proxy.ports is not None and proxy.ports.grpc is not None
        assert listen_queue_limit(port_of(proxy)) == 1000
        assert listen_queue_limit(proxy.ports.grpc) == 1000
    with proxy_on() as proxy:
        assert listen_queue_limit(port_of(proxy)) == 4096
