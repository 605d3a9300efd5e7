"""Generated bad requests for the fuzz suites (issue 9, point 9), deterministic from a seed.

:func:`http_cases` yields raw HTTP requests (bytes, sent with :mod:`tests.fakes.rawhttp`) and
:func:`grpc_cases` serialized gRPC messages (sent over a channel with identity serializers).
Each case says what the proxy must do with it beyond the global rules (no 5xx of its own, an
answer to every complete request, nothing refused reaching an instance):

- ``must_refuse``: a target the issue says must get 400 in Triton's error format (dot or
  empty segments, encoded separators, absolute-form, authority-form);
- ``may_drop``: the request is incomplete or not HTTP at all, so closing the connection
  without an answer is fine.

``safe=True`` keeps traversal targets to read-only routes, for runs against the shared real
Triton fleet: on a proxy that resolved ``..`` they would reach those routes and change nothing.
"""

from __future__ import annotations

import functools
import gzip
import json
import random
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tritonclient.grpc import service_pb2 as pb

from tests.fakes.rawhttp import build

KNOWN_MODELS = ("simple", "seq", "gen")
OTHER_KEY = "fuzz-offline-key"


@dataclass(frozen=True)
class HttpCase:
    kind: str
    data: bytes
    must_refuse: bool = False
    parser_level: bool = False
    """Rejected by the HTTP parser before any handler runs (a 400; aiohttp's server answered it
    in plain text, the proxy's own server in Triton's format)."""
    may_drop: bool = False
    half_close: bool = False

    def describe(self) -> str:
        return f"[{self.kind}] {self.data[:300]!r}"


@dataclass(frozen=True)
class GrpcCase:
    kind: str
    method: str
    messages: tuple[bytes, ...]
    stream: bool = False
    metadata: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        return f"[{self.kind}] {self.method} {[m[:80] for m in self.messages[:3]]!r}"


# --- pieces -------------------------------------------------------------------------------

DOTS = ("..", "%2e%2e", "%2E%2E", ".%2e", "%2e.", "%2E.", ".%2E")
SEPS = ("/", "%2F", "%2f", "%5C", "%5c", "\\")
DESTRUCTIVE = (
    ("POST", "repository/models/simple/unload"),
    ("POST", "repository/models/simple/load"),
    ("POST", "logging"),
    ("POST", "trace/setting"),
    ("POST", "systemsharedmemory/region/r/register"),
    ("POST", "cudasharedmemory/region/r/register"),
)
HARMLESS = (
    ("POST", "repository/index"),
    ("GET", "logging"),
    ("GET", "trace/setting"),
    ("GET", "health/ready"),
    ("GET", "models/simple/config"),
    ("GET", "systemsharedmemory/status"),
)
ODD_METHODS = (
    "GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE", "PROPFIND",
    "FOO", "get", "P0ST", "POST\x00", "M" * 300, "",
)  # fmt: skip
PLAIN_PATHS = (
    "/v2", "/v2/health/live", "/v2/health/ready", "/v2/models/simple", "/v2/models/simple/ready",
    "/v2/models/simple/config", "/v2/models/simple/stats", "/v2/models/simple/infer",
    "/v2/models/simple/versions/1/infer", "/v2/models/gen/generate",
    "/v2/models/gen/generate_stream", "/v2/models/stats", "/v2/repository/index",
    "/v2/repository/models/simple/load", "/v2/repository/models/simple/unload", "/v2/logging",
    "/v2/trace/setting", "/v2/models/simple/trace/setting", "/v2/systemsharedmemory/status",
    "/v2/cudasharedmemory/register", "/v3/models/simple/infer", "/metrics", "/", "/v2/",
    "/v2/models", "/v2/models/simple/bogus", "/v2/models/simple/infer?x=1",
    "/v2/models/simple/infer#frag", "/V2/MODELS/SIMPLE/INFER",
)  # fmt: skip
DTYPES = ("INT32", "INT64", "FP32", "BYTES", "BOOL", "INT33", "", "int32", "FP8", "STRING", 5)


def _ident(rng: random.Random, n: int | None = None) -> str:
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789_-."
    return "".join(rng.choice(alphabet) for _ in range(n or rng.randint(1, 24)))


def invented_model(rng: random.Random) -> str:
    """A model name no server has: plain, or with characters that need encoding."""
    roll = rng.random()
    if roll < 0.6:
        return "fz-" + _ident(rng)
    if roll < 0.8:
        return "fz-" + "".join(
            rng.choice("äé漢字 +!$&'()*,;=:@~") for _ in range(rng.randint(1, 8))
        )
    return "fz-" + _ident(rng, rng.randint(200, 3000))


def _quote_loose(name: str) -> str:
    """Percent-encode what may not appear raw in a request target (not '/' or '.')."""
    out = []
    for ch in name:
        if ch.isascii() and (ch.isalnum() or ch in "-._~!$&'()*+,;=:@"):
            out.append(ch)
        else:
            out.extend(f"%{b:02X}" for b in ch.encode())
    return "".join(out)


def _infer_doc(rng: random.Random, model: str = "simple") -> dict[str, Any]:
    data = [rng.randint(0, 9) for _ in range(16)]
    return {
        "id": str(rng.randint(0, 10**6)),
        "inputs": [
            {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": data},
            {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": data},
        ],
    }


def _json_infer(rng: random.Random, doc: Any, *, model: str = "simple", headers: Any = ()) -> bytes:
    body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    return build(
        "POST",
        f"/v2/models/{model}/infer",
        [("Content-Type", "application/json"), *headers],
        body,
    )


def _binary_body(rng: random.Random, sizes: list[Any], actual: list[int]) -> tuple[bytes, int]:
    doc = {
        "inputs": [
            {
                "name": f"INPUT{i}",
                "shape": [1, 16],
                "datatype": "INT32",
                "parameters": {"binary_data_size": size},
            }
            for i, size in enumerate(sizes)
        ],
        "parameters": {"priority": rng.choice([0, 1, 2, 3, 99])},
    }
    header = json.dumps(doc).encode()
    tail = b"".join(rng.randbytes(n) for n in actual)
    return header + tail, len(header)


# --- HTTP case families -------------------------------------------------------------------


def _traversal(rng: random.Random, safe: bool) -> HttpCase:
    method, dest = rng.choice(HARMLESS if safe or rng.random() < 0.4 else DESTRUCTIVE)
    dots = rng.choice(DOTS)
    sep = rng.choice(SEPS)
    style = rng.randrange(7)
    if style == 0:
        target = "/v2/models/" + (dots + sep) * rng.randint(1, 3) + dest
    elif style == 1:
        target = "/v2/models/simple/" + (dots + sep) * rng.randint(2, 4) + dest
    elif style == 2:
        target = f"/v2/models/x{sep}{dots}{sep}simple/infer"
    elif style == 3:
        target = "/v2/" + rng.choice(("./", "%2e/", ".%2F")) + dest
    elif style == 4:
        target = "/v2/" + dest + rng.choice(("/..", "/.", "/%2e%2e", "/", "//"))
    elif style == 5:
        target = "/" + dots + "/v2/" + dest
    else:
        target = "/v2/" + dest.replace("/", rng.choice(("//", "/./", "%2F", "%5C")), 1)
    if "/" not in dest and style == 6:
        target = "/v2//" + dest
    body = b"{}" if method == "POST" else b""
    return HttpCase("traversal", build(method, target, [], body), must_refuse=True)


def _ssrf(rng: random.Random, canary: int) -> HttpCase:
    host = rng.choice((f"127.0.0.1:{canary}", f"localhost:{canary}", "127.0.0.1:1", "[::1]:1"))
    path = rng.choice(("/x", "/v2/health/ready", "/v2/models/simple/infer", "/metrics", "/"))
    method = rng.choice(("GET", "POST"))
    style = rng.randrange(5)
    if style == 0:
        target = f"//{host}{path}"
    elif style == 1:
        target = f"///{host}{path}"
    elif style == 2:
        target = f"http://{host}{path}"
    elif style == 3:
        target = f"{rng.choice(('https', 'HTTP', 'ftp'))}://{host}{path}"
    else:
        method = rng.choice(("CONNECT", "GET"))
        target = host
    body = b"{}" if method == "POST" else b""
    data = build(method, target, [("Host", host)], body)
    parser = method != "CONNECT" and target == host
    return HttpCase("ssrf", data, must_refuse=True, parser_level=parser)


def _odd_method(rng: random.Random) -> HttpCase:
    method = rng.choice(ODD_METHODS)
    path = rng.choice(PLAIN_PATHS)
    body = json.dumps(_infer_doc(rng)).encode() if rng.random() < 0.5 else b""
    bad_line = not method or not method.isalnum() or method != method.upper()
    return HttpCase("method", build(method, path, [], body), may_drop=bad_line)


def _bad_headers(rng: random.Random) -> HttpCase:
    body = json.dumps(_infer_doc(rng)).encode()
    headers: list[tuple[str, str]] = []
    content_length: int | bool | None = True
    may_drop = False
    half_close = False
    style = rng.randrange(12)
    if style == 0:
        headers.append(("X-Big", "a" * rng.choice((9000, 70000, 200000))))
    elif style == 1:
        headers.extend((f"X-H{i}", _ident(rng)) for i in range(rng.choice((120, 500))))
    elif style == 2:
        headers.append(("X-Bad", rng.choice(("a\x00b", "\x7f", "é", "a\rb"))))
        may_drop = True
    elif style == 3:
        headers.append(("Content-Length", str(len(body) + rng.randint(1, 9))))
        may_drop = True
    elif style == 4:
        content_length = rng.choice((-1, 2**64, 10**30))
        may_drop = True
    elif style == 5:
        content_length = False
        headers.append(("Transfer-Encoding", rng.choice(("chunked", "gzip, chunked", "bogus"))))
        body = rng.choice((b"zz\r\n" + body + b"\r\n0\r\n\r\n", b"5\r\nab", b"0\r\n\r\n"))
        may_drop = half_close = True
    elif style == 6:
        headers.append(("Transfer-Encoding", "chunked"))
        body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        may_drop = half_close = True
    elif style == 7:
        headers.append(("Inference-Header-Content-Length", rng.choice(("-1", "0", "abc", "1e3"))))
    elif style == 8:
        n = rng.choice((len(body) + 100, 2**40, 3, len(body) - 1))
        headers.append(("Inference-Header-Content-Length", str(n)))
    elif style == 9:
        headers.append(("Authorization", rng.choice(("Bearer", "Bearer " + "k" * 5000, "Basic x"))))
        headers.append(("x-triton-proxy-class", rng.choice(("realtime", "x" * 300, ""))))
    elif style == 10:
        headers.append(("Expect", "100-continue"))
        headers.append(("Content-Type", rng.choice(("text/plain", "multipart/form-data", "x"))))
    else:
        headers.append(("Host", rng.choice(("", "a" * 3000, "127.0.0.1:1", "[::1"))))
    data = build("POST", "/v2/models/simple/infer", headers, body, content_length=content_length)
    return HttpCase("headers", data, may_drop=may_drop, half_close=half_close)


def _truncated(rng: random.Random) -> HttpCase:
    full = json.dumps(_infer_doc(rng)).encode()
    cut = rng.randint(0, len(full) - 1)
    declared = len(full) if rng.random() < 0.7 else len(full) + rng.randint(1, 10**6)
    data = build("POST", "/v2/models/simple/infer", [], full[:cut], content_length=declared)
    return HttpCase("truncated", data, may_drop=True, half_close=True)


def _short_length(rng: random.Random) -> HttpCase:
    full = json.dumps(_infer_doc(rng)).encode()
    declared = rng.randint(0, len(full) - 1)
    data = build("POST", "/v2/models/simple/infer", [], full, content_length=declared)
    return HttpCase("short-length", data)


def _binary_sizes(rng: random.Random) -> HttpCase:
    actual = [64, 64]
    sizes: list[Any] = rng.choice(
        (
            [64, 64 + rng.randint(1, 100)],
            [-1, 64],
            [2**62, 64],
            ["64", 64],
            [None, 64],
            [64.5, 64],
            [0, 0],
            [64, 64, 64],
            [10**30, 1],
        )
    )
    body, header_len = _binary_body(rng, sizes, actual)
    lie = rng.choice((header_len, header_len + rng.randint(1, 50), header_len - 3, None))
    headers = [("Content-Type", "application/octet-stream")]
    if lie is not None:
        headers.append(("Inference-Header-Content-Length", str(lie)))
    return HttpCase("binary-size", build("POST", "/v2/models/simple/infer", headers, body))


def _dtypes_shapes(rng: random.Random) -> HttpCase:
    doc = _infer_doc(rng)
    item = doc["inputs"][0]
    style = rng.randrange(4)
    if style == 0:
        item["datatype"] = rng.choice(DTYPES)
    elif style == 1:
        item["shape"] = rng.choice(
            ([1, 2**40], [-5], [2**63], [1e30], [1] * 1000, "16", [], [0], [2**31, 2**31])
        )
    elif style == 2:
        item["data"] = rng.choice((["a"] * 16, [1.5] * 16, [[1, 2]] * 16, None, {}, [2**70] * 16))
    else:
        item["datatype"] = "BYTES"
        item["data"] = [rng.randbytes(8).hex()] * 16
    return HttpCase("dtype-shape", _json_infer(rng, doc))


def _invalid_json(rng: random.Random) -> HttpCase:
    valid = json.dumps(_infer_doc(rng)).encode()
    style = rng.randrange(10)
    body: bytes
    if style == 0:
        body = valid[: rng.randint(1, len(valid) - 1)]
    elif style == 1:
        body = rng.randbytes(rng.randint(1, 400))
    elif style == 2:
        depth = rng.choice((1000, 100_000))
        body = b'{"parameters": {"a": ' + b"[" * depth + b"]" * depth + b"}}"
    elif style == 3:
        body = b'{"parameters": {"priority": 1e999, "sequence_id": 1' + b"0" * 400 + b"}}"
    elif style == 4:
        body = b'{"parameters": {"priority": NaN, "timeout": Infinity}, "inputs": []}'
    elif style == 5:
        body = b'{"parameters": {"priority": 1}, "parameters": [], "inputs": []}'
    elif style == 6:
        body = "\ufeff".encode() + valid
    elif style == 7:
        body = valid.decode().encode("utf-16")
    elif style == 8:
        body = b'{"parameters": ' + json.dumps(rng.choice(([], "x", 1, None, {"": {}}))).encode()
        body += b', "inputs": []}'
    else:
        body = b'{"parameters": {"a": "' + b"\\ud800" * 50 + b'"}, "inputs": []}'
    return HttpCase("json", _json_infer(rng, body))


def _params(rng: random.Random) -> HttpCase:
    model = rng.choice(KNOWN_MODELS)
    params = {
        "sequence_id": rng.choice((-1, 0, 2**64, 2**70, "abc", "x" * 5000, 1.5, True, [], None)),
        "sequence_start": rng.choice((True, False, "yes", 1)),
        "sequence_end": rng.choice((True, False, None)),
        "priority": rng.choice((-1, 0, 1, 2**63, 2**70, "1", 1.5, None)),
        "timeout": rng.choice((-1, 0, 2**64, "x")),
    }
    params = {k: v for k, v in params.items() if rng.random() < 0.6}
    doc = _infer_doc(rng)
    doc["parameters"] = params
    headers = [("Authorization", f"Bearer {OTHER_KEY}")] if rng.random() < 0.5 else []
    return HttpCase("params", _json_infer(rng, doc, model=model, headers=headers))


@functools.cache
def _gzip_bomb() -> bytes:
    """About 64 KiB that inflate to 64 MiB."""
    return gzip.compress(b"\0" * (64 << 20), compresslevel=9)


def _compressed(rng: random.Random) -> HttpCase:
    doc = _infer_doc(rng)
    doc["parameters"] = {"priority": 1}
    raw = json.dumps(doc).encode()
    style = rng.randrange(7)
    if style == 0:
        body, enc = raw, "gzip"  # a lie: not compressed
    elif style == 1:
        body, enc = gzip.compress(raw), "deflate"
    elif style == 2:
        body, enc = gzip.compress(raw)[:-8], "gzip"  # truncated
    elif style == 3:
        body, enc = zlib.compress(raw), rng.choice(("br", "x-unknown", "gzip, identity", "*"))
    elif style == 4:
        body, enc = raw, "identity"
    elif style == 5:
        body, enc = _gzip_bomb(), "gzip"
    else:
        body, enc = gzip.compress(raw), "gzip"
    headers = [("Content-Encoding", enc), ("Authorization", f"Bearer {OTHER_KEY}")]
    return HttpCase("compressed", build("POST", "/v2/models/simple/infer", headers, body))


def _generate(rng: random.Random) -> HttpCase:
    path = rng.choice(("/v2/models/gen/generate", "/v2/models/gen/generate_stream"))
    body = rng.choice(
        (
            b'{"text_input": "hi", "parameters": {"priority": 1, "stream": true}}',
            b'{"text_input": ',
            b'{"text_input": ["a", {"b": 1}], "priority": "x"}',
            rng.randbytes(50),
            b"[]",
        )
    )
    headers = [("Authorization", f"Bearer {OTHER_KEY}")]
    return HttpCase("generate", build("POST", path, headers, body))


def _admin(rng: random.Random) -> HttpCase:
    path = rng.choice(
        (
            "/v2/repository/models/simple/unload",
            "/v2/repository/models/simple/load",
            "/v2/repository/index",
            "/v2/logging",
            "/v2/trace/setting",
        )
    )
    token = rng.choice(("", "Bearer wrong", "Bearer ", "bearer fuzz-admin-tokeN", "Basic xyz"))
    headers = [("Authorization", token)] if token else []
    return HttpCase("admin", build("POST", path, headers, b'{"log_verbose_level": 1}'))


def _unknown_model(rng: random.Random) -> HttpCase:
    target = f"/v2/models/{_quote_loose(invented_model(rng))}/infer"
    return HttpCase(
        "unknown-model", build("POST", target, [], json.dumps(_infer_doc(rng)).encode())
    )


def _garbage(rng: random.Random) -> HttpCase:
    data = rng.choice(
        (
            rng.randbytes(rng.randint(1, 2000)),
            b"GET /v2/health/ready HTTP/9.9\r\n\r\n",
            b"GET /v2/health/ready\r\n\r\n",
            b"\r\n\r\n\r\n",
            b"GET " + b"/v2" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        )
    )
    return HttpCase("garbage", data, may_drop=True, half_close=True)


def _safe(case: HttpCase) -> bool:
    """Nothing that would change a real Triton server if the proxy let it through."""
    return case.kind not in ("admin",) and b"/unload" not in case.data and b"/load" not in case.data


def http_cases(
    rng: random.Random, count: int, *, canary_port: int, safe: bool = False
) -> Iterator[HttpCase]:
    families = (
        (12, lambda: _traversal(rng, safe)),
        (6, lambda: _ssrf(rng, canary_port)),
        (6, lambda: _odd_method(rng)),
        (10, lambda: _bad_headers(rng)),
        (5, lambda: _truncated(rng)),
        (4, lambda: _short_length(rng)),
        (8, lambda: _binary_sizes(rng)),
        (8, lambda: _dtypes_shapes(rng)),
        (10, lambda: _invalid_json(rng)),
        (8, lambda: _params(rng)),
        (6, lambda: _compressed(rng)),
        (5, lambda: _generate(rng)),
        (4, lambda: _admin(rng)),
        (6, lambda: _unknown_model(rng)),
        (2, lambda: _garbage(rng)),
    )
    weights = [w for w, _ in families]
    makers = [m for _, m in families]
    made = 0
    while made < count:
        case = rng.choices(makers, weights)[0]()
        if safe and not _safe(case):
            continue
        made += 1
        yield case


# --- gRPC ---------------------------------------------------------------------------------


def _valid_infer(rng: random.Random, model: str = "simple") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, id=str(rng.randint(0, 999)))
    for name in ("INPUT0", "INPUT1"):
        tensor = request.inputs.add()
        tensor.name, tensor.datatype = name, "INT32"
        tensor.shape.extend([1, 16])
        request.raw_input_contents.append(struct.pack("<16i", *range(16)))
    return request


def _grpc_message(rng: random.Random) -> tuple[str, bytes]:
    valid = _valid_infer(rng, rng.choice(KNOWN_MODELS))
    encoded = valid.SerializeToString()
    style = rng.randrange(10)
    if style == 0:
        return "random-bytes", rng.randbytes(rng.randint(0, 300))
    if style == 1:
        return "truncated", encoded[: rng.randint(1, len(encoded) - 1)]
    if style == 2:
        # Field 1 (model_name) claiming a length far past the end.
        return "bad-length", b"\x0a\xff\xff\xff\xff\x0f" + encoded
    if style == 3:
        return "bad-wire-type", b"\x0f" + encoded
    if style == 4:
        valid.model_name = invented_model(rng)
        return "unknown-model", valid.SerializeToString()
    if style == 5:
        valid.parameters["sequence_id"].string_param = rng.choice(("abc", "x" * 3000))
        valid.model_name = "seq"
        return "string-seq", valid.SerializeToString()
    if style == 6:
        valid.parameters["priority"].string_param = "1"
        valid.parameters["sequence_id"].int64_param = rng.choice((-1, 2**62))
        return "odd-params", valid.SerializeToString()
    if style == 7:
        valid.inputs[0].shape[:] = [2**40, 2**20]
        valid.inputs[0].datatype = rng.choice(("INT33", "", "BYTES"))
        return "dtype-shape", valid.SerializeToString()
    if style == 8:
        # Parameters map entry whose value is garbage.
        return "bad-map", encoded + b"\x22\x06\x0a\x01p\x12\x01\xff"
    return "duplicate-model", encoded + pb.ModelInferRequest(model_name="seq").SerializeToString()


def grpc_cases(rng: random.Random, count: int, *, safe: bool = False) -> Iterator[GrpcCase]:
    service = "/inference.GRPCInferenceService/"
    for _ in range(count):
        roll = rng.random()
        metadata: tuple[tuple[str, str], ...] = ()
        if rng.random() < 0.3:
            metadata = (("authorization", f"Bearer {OTHER_KEY}"),)
        if roll < 0.6:
            kind, message = _grpc_message(rng)
            yield GrpcCase(kind, service + "ModelInfer", (message,), metadata=metadata)
        elif roll < 0.8:
            messages = tuple(_grpc_message(rng)[1] for _ in range(rng.randint(1, 4)))
            yield GrpcCase(
                "stream", service + "ModelStreamInfer", messages, stream=True, metadata=metadata
            )
        else:
            methods = ["ModelConfig", "ModelMetadata", "ModelReady", "NoSuchMethod"]
            methods += ["ModelStatistics", "SystemSharedMemoryRegister"]
            if not safe:
                methods += ["RepositoryModelUnload", "LogSettings"]
            method = rng.choice(methods)
            yield GrpcCase(
                "control", service + method, (rng.randbytes(rng.randint(0, 60)),), metadata=metadata
            )
