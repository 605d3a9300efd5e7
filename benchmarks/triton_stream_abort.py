"""Does Triton abort on a gRPC stream that mixes a decoupled model's error with others?

    .venv/bin/python benchmarks/triton_stream_abort.py --streams 4000
    .venv/bin/python benchmarks/triton_stream_abort.py --streams 4000 --split
    .venv/bin/python benchmarks/triton_stream_abort.py --streams 4000 --through-proxy

One local Triton (the one this project runs, `nvidia-pytriton`'s) with `simple` and
`text_generator`. Each stream is a fresh `ModelStreamInfer` call of the aio client carrying,
one at a time (each sent after the previous answer), three failing requests: an unknown
model, `text_generator` (decoupled) with `max_tokens` 0, and `simple` with a wrong shape.
``--split`` sends the two non-decoupled ones on one stream and the decoupled one on another.
``--through-proxy`` sends them through a triton-proxy with the default policy, which relays a
stream that mixes the two kinds as two upstream calls. Stops at the first server death and
prints after how many streams, with the server's last log lines.

Why: session 12's CI run lost a Triton server to ``ASSERTION FAILED: !byte_buffer->Valid()``
(SIGABRT) in the compatibility test that sent these three on one stream. Measured with this
script (session 12): mixed, about 1 abort in 3,000 streams; split, none in 20,000; mixed
through the proxy once it split them, none in 12,000 (docs/triton-notes.md, "Errors on one
gRPC stream").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc.aio as grpcclient

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from proxy.local import LocalFleet  # noqa: E402

Request = tuple[str, list[Any]]


def _tensor(name: str, value: np.ndarray, datatype: str) -> Any:
    tensor = grpcclient.InferInput(name, list(value.shape), datatype)
    tensor.set_data_from_numpy(value)
    return tensor


def _simple(length: int) -> list[Any]:
    value = np.arange(length, dtype=np.int32).reshape(1, length)
    return [_tensor("INPUT0", value, "INT32"), _tensor("INPUT1", value, "INT32")]


UNKNOWN: Request = ("no_such_model", _simple(16))
DECOUPLED_ERROR: Request = (
    "text_generator",
    [
        _tensor("text_input", np.array([b"x"], dtype=np.object_), "BYTES"),
        _tensor("max_tokens", np.array([0], dtype=np.int32), "INT32"),
    ],
)
BAD_SHAPE: Request = ("simple", _simple(8))


async def one_stream(client: Any, requests: list[Request]) -> None:
    arrived: asyncio.Queue[None] = asyncio.Queue()

    async def gen() -> AsyncIterator[dict[str, Any]]:
        for n, (model, inputs) in enumerate(requests):
            if n:
                await arrived.get()
            yield {"model_name": model, "inputs": inputs}

    async for _ in client.stream_infer(gen(), stream_timeout=30):
        arrived.put_nowait(None)


async def run(address: str, streams: list[list[Request]], count: int, fleet: LocalFleet) -> int:
    """Streams sent before the server died, or ``count``."""
    for n in range(count):
        async with grpcclient.InferenceServerClient(address) as client:
            for requests in streams:
                try:
                    await one_stream(client, requests)
                except Exception as exc:  # any failure: was it a death?
                    dead = fleet.revive(timeout_s=240)
                    if dead:
                        print(f"server died during stream {n + 1}:\n{dead[0]}")
                        return n
                    print(f"stream {n + 1} failed, server alive: {exc}")
    return count


@contextlib.contextmanager
def _proxy(fleet: LocalFleet) -> Iterator[str]:
    sys.path.insert(0, str(ROOT / "tests" / "integration"))
    from harness import running_proxy

    with running_proxy(fleet.servers) as proxy:
        yield proxy.grpc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--streams", type=int, default=4000)
    p.add_argument("--split", action="store_true")
    p.add_argument("--through-proxy", action="store_true")
    args = p.parse_args()
    streams = (
        [[UNKNOWN, BAD_SHAPE], [DECOUPLED_ERROR]]
        if args.split
        else [[UNKNOWN, DECOUPLED_ERROR, BAD_SHAPE]]
    )
    log_dir = Path(tempfile.mkdtemp(prefix="stream-abort-"))
    fleet = LocalFleet(1, ROOT / "model_repository", ("simple", "text_generator"), log_dir)
    fleet.start(timeout_s=240)
    try:
        with (
            _proxy(fleet)
            if args.through_proxy
            else contextlib.nullcontext(str(fleet.server(0).grpc_address)) as address
        ):
            sent = asyncio.run(run(address, streams, args.streams, fleet))
    finally:
        fleet.stop()
    kind = "split" if args.split else "mixed"
    print(f"{kind}: {sent} of {args.streams} streams before the first abort (logs: {log_dir})")


if __name__ == "__main__":
    main()
