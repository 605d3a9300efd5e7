"""Sends fuzz cases and judges the answers by the rules every case shares."""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from tests.fakes.fuzz import GrpcCase, HttpCase
from tests.fakes.rawhttp import RawResponse, exchange

SHARED_MEMORY_REFUSAL = "shared memory is not supported through triton-proxy"
# Answers that mean the proxy itself failed (the fakes never answer these unless told).
GRPC_FAILURES = frozenset(
    (
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DATA_LOSS,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    )
)
# Log lines of an exception nobody handled: a handler's exception is logged "unexpected error
# answering" by the proxy's HTTP server and "Error handling request" by aiohttp's (the metrics
# port); asyncio logs "... exception was never retrieved".
UNHANDLED_IN_LOG = re.compile(
    r"Traceback|unexpected error answering|Error handling request|exception was never retrieved"
    r"|Unhandled exception"
)
_LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", re.M)


def unhandled_errors(log: str) -> list[str]:
    """Log records of exceptions nobody handled."""
    starts = [m.start() for m in _LOG_RECORD.finditer(log)] + [len(log)]
    records = [log[a:b] for a, b in itertools.pairwise(starts)]
    return [r.strip()[:1500] for r in records if UNHANDLED_IN_LOG.search(r)]


@dataclass
class HttpResult:
    case: HttpCase
    response: RawResponse
    seconds: float = 0.0


@dataclass
class GrpcResult:
    case: GrpcCase
    code: grpc.StatusCode
    details: str
    replies: int = 0


async def send_http(
    cases: Iterable[HttpCase], port: int, *, concurrency: int = 24, timeout_s: float = 15
) -> list[HttpResult]:
    sem = asyncio.Semaphore(concurrency)

    async def one(case: HttpCase) -> HttpResult:
        async with sem:
            began = time.monotonic()
            response = await exchange(
                "127.0.0.1", port, case.data, timeout_s=timeout_s, half_close=case.half_close
            )
            return HttpResult(case, response, time.monotonic() - began)

    return list(await asyncio.gather(*(one(c) for c in cases)))


def http_problem(result: HttpResult) -> str | None:
    """What is wrong with the proxy's answer to one case, or None."""
    r, case = result.response, result.case
    if r.status is None:
        if case.may_drop and "timed out" not in r.error:
            return None
        return f"no answer: {r.error}"
    if r.status >= 500:
        if r.status == 501 and SHARED_MEMORY_REFUSAL in r.body.decode(errors="replace"):
            return None
        return f"5xx of the proxy's own: {r.status} {r.body[:300]!r}"
    if case.must_refuse:
        if r.status != 400:
            return f"expected 400 for a refused target, got {r.status} {r.body[:200]!r}"
        if r.triton_error() is None and not case.parser_level:
            return f"400 without Triton's error format: {r.body[:200]!r}"
    return None


async def send_grpc(
    cases: Iterable[GrpcCase], target: str, *, concurrency: int = 16, timeout_s: float = 15
) -> list[GrpcResult]:
    sem = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(target) as channel:

        async def one(case: GrpcCase) -> GrpcResult:
            async with sem:
                try:
                    if not case.stream:
                        call = channel.unary_unary(case.method)
                        await call(case.messages[0], metadata=case.metadata, timeout=timeout_s)
                        return GrpcResult(case, grpc.StatusCode.OK, "", 1)
                    stream = channel.stream_stream(case.method)(
                        iter(case.messages), metadata=case.metadata, timeout=timeout_s
                    )
                    replies = 0
                    async for _ in stream:
                        replies += 1
                    return GrpcResult(case, grpc.StatusCode.OK, "", replies)
                except grpc.aio.AioRpcError as exc:
                    return GrpcResult(case, exc.code(), exc.details() or "")

        return list(await asyncio.gather(*(one(c) for c in cases)))


# grpc.aio's *client* reports a stream that the server ended (with any status) while the
# client's request iterator was still being written as INTERNAL "Internal error from Core",
# about 1 time in 5 (measured against a bare grpc.aio server that aborts INVALID_ARGUMENT
# after the first message: the synchronous client sees INVALID_ARGUMENT 100 times in 100).
AIO_CLIENT_ARTIFACT = "Internal error from Core"


def grpc_problem(result: GrpcResult) -> str | None:
    if (
        result.case.stream
        and result.code == grpc.StatusCode.INTERNAL
        and result.details == AIO_CLIENT_ARTIFACT
    ):
        return None
    if result.code in GRPC_FAILURES:
        return f"{result.code.name}: {result.details[:300]}"
    return None
