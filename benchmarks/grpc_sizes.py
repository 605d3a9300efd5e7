"""CPU per call of the bare gRPC relays (``grpc.aio``; the proxy's own HTTP/2) by message size.

    flock /tmp/bench.lock .venv/bin/python benchmarks/grpc_sizes.py 16384 1048576 3145728

For each size (bytes of tensor data in a ``ModelInferRequest``): calls/s straight to a fake
Triton (``cpu_ab.FAKE``), then through each bare relay of ``cpu_ab`` (``GRPC_PIPE``,
``H2_PIPE``), 4 closed-loop clients for ``--seconds``, and the relay process's CPU per call.
Small messages show what a call costs; large ones what copying a tensor costs.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import grpc
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_ab

PATH = "/inference.GRPCInferenceService/ModelInfer"
OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def request(size: int) -> bytes:
    """model_name "simple" and ``size`` bytes of raw_input_contents (field 7)."""
    return b"\x0a\x06simple" + b"\x3a" + _varint(size) + bytes(size)


async def rate(address: str, body: bytes, seconds: float, clients: int = 4) -> float:
    async with grpc.aio.insecure_channel(address, options=OPTIONS) as channel:
        call = channel.unary_unary(PATH)
        for _ in range(3):
            await call(body)
        done = 0
        end = time.monotonic() + seconds

        async def loop() -> None:
            nonlocal done
            while time.monotonic() < end:
                await call(body)
                done += 1

        await asyncio.gather(*(loop() for _ in range(clients)))
    return done / seconds


async def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("sizes", nargs="+", type=int, help="tensor bytes per request (< 4 MiB)")
    p.add_argument("--seconds", type=float, default=4.0)
    args = p.parse_args()
    with cpu_ab.script_process(cpu_ab.FAKE) as (_, ports):
        upstream = f"127.0.0.1:{ports.split()[1]}"
        for size in args.sizes:
            body = request(size)
            direct = await rate(upstream, body, args.seconds)
            print(f"{size:>9} B  direct {direct:6.0f} calls/s")
            for name, script in (("grpc.aio", cpu_ab.GRPC_PIPE), ("proxy.h2", cpu_ab.H2_PIPE)):
                with cpu_ab.script_process(script, upstream) as (relay, port):
                    address = f"127.0.0.1:{port}"
                    await rate(address, body, 1.0)
                    before = cpu_ab.thread_cpu_s(relay.pid)
                    calls = await rate(address, body, args.seconds)
                    spent = cpu_ab.thread_cpu_s(relay.pid) - before
                    cpu_ms = 1000 * spent / (calls * args.seconds)
                    print(f"{'':>11}  {name:<9} {calls:6.0f} calls/s  {cpu_ms:.2f} ms CPU per call")
    return 0


if __name__ == "__main__":
    sys.exit(uvloop.run(main()))
