"""The HTTP routes the proxy relays: canonical paths matched against an explicit table.

A gateway must never let a client's path pick what it reaches upstream. So the raw request
target is checked before anything else, and refused with 400 in Triton's error format when it
is not in canonical form:

- it must be origin-form (``/v2/...``): absolute-form (``http://host/...``), authority-form
  (``host:port``) and asterisk-form targets are refused;
- no empty segment (``//``), no dot-segment (``.``, ``..``), no encoded separator or dot
  (``%2F``, ``%5C``, ``%2E``), no backslash, no control character;
- model names are checked once, here (:func:`check_model_name`), and used as they are from then
  on, in the upstream path, the routing tables and the metric labels.

The path is then matched against :data:`ROUTES`, the KServe v2 routes and Triton extensions
that Triton 2.51 serves (its ``server_regex_``, ``model_regex_``, ``modelcontrol_regex_``,
shared-memory and trace/logging routes in ``http_server.cc``). The upstream path is *built*
from the matched route's parts (:attr:`Route.upstream_path`), never copied from the client;
the query string is dropped (no Triton route reads one).
"""

from __future__ import annotations

import enum
import functools
import re
from dataclasses import dataclass
from urllib.parse import unquote

from proxy.errors import Code, ProxyError

MODEL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,255}")
"""Model names the proxy relays: the characters Triton model directories use in practice, none
of which needs percent-encoding, so the name means the same to every hop."""

_VERSION = re.compile(r"[0-9]{1,19}")
_ENCODED_FORBIDDEN = re.compile(r"%(?:2[fFeE]|5[cC]|00)")
_PERCENT = re.compile(r"%(?![0-9A-Fa-f]{2})")


class Kind(enum.Enum):
    """What the proxy does with a matched route."""

    LIVE = "live"
    READY = "ready"
    INFER = "infer"
    GENERATE = "generate"
    GENERATE_STREAM = "generate_stream"
    READ = "read"
    """Metadata, config, statistics, model readiness, settings reads: any ready instance."""
    ADMIN_FIRST = "admin_first"
    """Repository index: admin only, one instance answers."""
    ADMIN_ALL = "admin_all"
    """Load, unload, settings changes: admin only, sent to every instance."""
    SHARED_MEMORY = "shared_memory"


INFERENCE_KINDS = frozenset((Kind.INFER, Kind.GENERATE, Kind.GENERATE_STREAM))
ADMIN_KINDS = frozenset((Kind.ADMIN_FIRST, Kind.ADMIN_ALL))


@dataclass(frozen=True, slots=True)
class Route:
    kind: Kind
    upstream_path: str
    """The path to request from Triton, built from the canonical parts."""
    model: str | None = None
    shm_kind: str = ""
    """``system`` or ``cuda`` for shared-memory routes."""
    shm_region: str = ""
    shm_action: str = ""


def bad_request(message: str) -> ProxyError:
    return ProxyError(Code.INVALID_ARG, message)


def check_model_name(name: str) -> str:
    """``name`` when the proxy relays it unchanged, else :class:`ProxyError` (400)."""
    if not MODEL_NAME.fullmatch(name) or name in (".", ".."):
        shown = name if len(name) <= 64 else name[:64] + "..."
        raise bad_request(
            f"model name {shown!r} is not accepted by triton-proxy: use 1-255 characters "
            "from A-Z, a-z, 0-9, '_', '.' and '-'"
        )
    return name


def not_origin_form() -> ProxyError:
    return bad_request(
        "request target must be an absolute path such as /v2/models/NAME/infer "
        "(absolute-form and authority-form targets are not accepted)"
    )


def segments(raw_target: str) -> list[str]:
    """The decoded segments of an origin-form path, or :class:`ProxyError` (400)."""
    path, _, _ = raw_target.partition("?")
    path = path.partition("#")[0]
    if not path.startswith("/") or path.startswith("//"):
        raise not_origin_form()
    if _ENCODED_FORBIDDEN.search(path) or _PERCENT.search(path):
        raise bad_request(
            "request path contains an encoded '/', '\\', '.' or NUL, or a malformed "
            "percent-escape; send the path in canonical form"
        )
    parts = path[1:].split("/")
    out = []
    for part in parts:
        if part in ("", ".", ".."):
            raise bad_request(
                "request path contains an empty or dot segment ('//', '/./' or '/../'); "
                "send the path in canonical form"
            )
        decoded = unquote(part, errors="strict")
        if "\\" in decoded or any(ord(c) < 0x20 or ord(c) == 0x7F for c in decoded):
            raise bad_request("request path contains a backslash or a control character")
        out.append(decoded)
    return out


_MODEL_ACTIONS: dict[tuple[str, ...], tuple[str, Kind]] = {
    # (method, action) -> (action path, kind); action () is the model's metadata.
    ("GET",): ("", Kind.READ),
    ("GET", "ready"): ("/ready", Kind.READ),
    ("GET", "config"): ("/config", Kind.READ),
    ("GET", "stats"): ("/stats", Kind.READ),
    ("POST", "infer"): ("/infer", Kind.INFER),
    ("POST", "generate"): ("/generate", Kind.GENERATE),
    ("POST", "generate_stream"): ("/generate_stream", Kind.GENERATE_STREAM),
    ("GET", "trace", "setting"): ("/trace/setting", Kind.READ),
    ("POST", "trace", "setting"): ("/trace/setting", Kind.ADMIN_ALL),
}
_MODEL_PATHS = frozenset(key[1:] for key in _MODEL_ACTIONS)

_FIXED: dict[tuple[str, ...], tuple[str, Kind]] = {
    # (method, *segments) -> kind; the upstream path is the canonical path itself.
    ("GET", "v2"): ("/v2", Kind.READ),
    ("GET", "v2", "health", "live"): ("/v2/health/live", Kind.LIVE),
    ("GET", "v2", "health", "ready"): ("/v2/health/ready", Kind.READY),
    ("GET", "v2", "models", "stats"): ("/v2/models/stats", Kind.READ),
    ("GET", "v2", "trace", "setting"): ("/v2/trace/setting", Kind.READ),
    ("POST", "v2", "trace", "setting"): ("/v2/trace/setting", Kind.ADMIN_ALL),
    ("GET", "v2", "logging"): ("/v2/logging", Kind.READ),
    ("POST", "v2", "logging"): ("/v2/logging", Kind.ADMIN_ALL),
    ("POST", "v2", "repository", "index"): ("/v2/repository/index", Kind.ADMIN_FIRST),
}
_FIXED_PATHS = frozenset(key[1:] for key in _FIXED)

_SHM_KINDS = {"systemsharedmemory": "system", "cudasharedmemory": "cuda"}
_SHM_ACTIONS = {"status": "GET", "register": "POST", "unregister": "POST"}


class MethodNotAllowed(ProxyError):
    def __init__(self) -> None:
        super().__init__(Code.METHOD_NOT_ALLOWED, "Method Not Allowed")


def not_found() -> ProxyError:
    # What Triton answers for a path none of its routes matches.
    return ProxyError(Code.NOT_FOUND, "Not Found")


@functools.lru_cache(maxsize=4096)
def match(method: str, raw_target: str) -> Route:
    """The route for ``method`` and the raw request target, or :class:`ProxyError`.

    Memoised (refusals raise, so they are not): the same few targets
    (``/v2/models/<name>/infer``) arrive on every request, and checking one took about 4 % of
    the proxy's CPU per request under load (py-spy, docs/benchmarks.md). A :class:`Route` is
    frozen and depends on nothing but its arguments, so a remembered one is the same answer.
    """
    parts = segments(raw_target)
    key = tuple(parts)
    fixed = _FIXED.get((method, *key))
    if fixed is not None:
        return Route(fixed[1], fixed[0])
    if key in _FIXED_PATHS:
        raise MethodNotAllowed()
    if len(parts) >= 3 and parts[0] == "v2":
        if parts[1] == "models":
            return _model_route(method, parts[2:])
        if parts[1] == "repository":
            return _repository_route(method, parts[2:])
        if parts[1] in _SHM_KINDS:
            return _shared_memory_route(method, _SHM_KINDS[parts[1]], parts[2:])
    raise not_found()


def _model_route(method: str, rest: list[str]) -> Route:
    name = check_model_name(rest[0])
    base = f"/v2/models/{name}"
    rest = rest[1:]
    if len(rest) >= 2 and rest[0] == "versions":
        if not _VERSION.fullmatch(rest[1]):
            raise not_found()
        base += f"/versions/{rest[1]}"
        rest = rest[2:]
    action = tuple(rest)
    found = _MODEL_ACTIONS.get((method, *action))
    if found is None:
        if action in _MODEL_PATHS:
            raise MethodNotAllowed()
        raise not_found()
    return Route(found[1], base + found[0], model=name)


def _repository_route(method: str, rest: list[str]) -> Route:
    # /v2/repository[/REPO]/index and /v2/repository[/REPO]/models/NAME/(load|unload)
    prefix = "/v2/repository"
    if rest and rest[0] not in ("index", "models"):
        prefix += "/" + check_model_name(rest[0])  # a repository name: same character rules
        rest = rest[1:]
    if rest == ["index"]:
        if method != "POST":
            raise MethodNotAllowed()
        return Route(Kind.ADMIN_FIRST, prefix + "/index")
    if len(rest) == 3 and rest[0] == "models" and rest[2] in ("load", "unload"):
        if method != "POST":
            raise MethodNotAllowed()
        name = check_model_name(rest[1])
        return Route(Kind.ADMIN_ALL, f"{prefix}/models/{name}/{rest[2]}", model=name)
    raise not_found()


def _shared_memory_route(method: str, shm_kind: str, rest: list[str]) -> Route:
    # /v2/{kind}sharedmemory[/region/NAME]/(status|register|unregister)
    region = ""
    if len(rest) == 3 and rest[0] == "region":
        region, rest = rest[1], rest[2:]
    if len(rest) != 1 or rest[0] not in _SHM_ACTIONS:
        raise not_found()
    action = rest[0]
    if method != _SHM_ACTIONS[action]:
        raise MethodNotAllowed()
    # Answered by the proxy itself: nothing is sent upstream.
    return Route(Kind.SHARED_MEMORY, "", shm_kind=shm_kind, shm_region=region, shm_action=action)
