"""The HTTP route table: canonical paths only, upstream paths built from the match."""

import pytest

from proxy.errors import Code, ProxyError
from proxy.frontends.routes import Kind, check_model_name, match


@pytest.mark.parametrize(
    ("method", "target", "kind", "upstream", "model"),
    [
        ("GET", "/v2/health/live", Kind.LIVE, "/v2/health/live", None),
        ("GET", "/v2/health/ready", Kind.READY, "/v2/health/ready", None),
        ("GET", "/v2", Kind.READ, "/v2", None),
        ("GET", "/v2/models/stats", Kind.READ, "/v2/models/stats", None),
        ("POST", "/v2/models/simple/infer", Kind.INFER, "/v2/models/simple/infer", "simple"),
        (
            "POST",
            "/v2/models/simple/versions/1/infer?x=1",
            Kind.INFER,
            "/v2/models/simple/versions/1/infer",
            "simple",
        ),
        ("POST", "/v2/models/g/generate", Kind.GENERATE, "/v2/models/g/generate", "g"),
        (
            "POST",
            "/v2/models/g/generate_stream",
            Kind.GENERATE_STREAM,
            "/v2/models/g/generate_stream",
            "g",
        ),
        ("GET", "/v2/models/m.v2-x_y", Kind.READ, "/v2/models/m.v2-x_y", "m.v2-x_y"),
        ("GET", "/v2/models/m/versions/3/ready", Kind.READ, "/v2/models/m/versions/3/ready", "m"),
        ("GET", "/v2/models/m/config", Kind.READ, "/v2/models/m/config", "m"),
        ("GET", "/v2/models/m/stats", Kind.READ, "/v2/models/m/stats", "m"),
        ("GET", "/v2/models/m/trace/setting", Kind.READ, "/v2/models/m/trace/setting", "m"),
        ("POST", "/v2/models/m/trace/setting", Kind.ADMIN_ALL, "/v2/models/m/trace/setting", "m"),
        ("GET", "/v2/trace/setting", Kind.READ, "/v2/trace/setting", None),
        ("POST", "/v2/logging", Kind.ADMIN_ALL, "/v2/logging", None),
        ("POST", "/v2/repository/index", Kind.ADMIN_FIRST, "/v2/repository/index", None),
        (
            "POST",
            "/v2/repository/models/simple/unload",
            Kind.ADMIN_ALL,
            "/v2/repository/models/simple/unload",
            "simple",
        ),
        ("POST", "/v2/models/%73imple/infer", Kind.INFER, "/v2/models/simple/infer", "simple"),
    ],
)
def test_routes_match_and_build_the_upstream_path(
    method: str, target: str, kind: Kind, upstream: str, model: str | None
) -> None:
    route = match(method, target)
    assert (route.kind, route.upstream_path, route.model) == (kind, upstream, model)


def test_shared_memory_is_answered_by_the_proxy() -> None:
    route = match("POST", "/v2/cudasharedmemory/region/r0/register")
    assert (route.kind, route.shm_kind, route.shm_region, route.shm_action) == (
        Kind.SHARED_MEMORY,
        "cuda",
        "r0",
        "register",
    )
    assert route.upstream_path == ""
    assert match("GET", "/v2/systemsharedmemory/status").shm_action == "status"


@pytest.mark.parametrize(
    "target",
    [
        "/v2/models/../repository/models/simple/unload",
        "/v2/models/./simple/infer",
        "//127.0.0.1:8002/metrics",
        "//127.0.0.1:1/x",
        "/v2//models/simple/infer",
        "/v2/models/simple/infer/",
        "/v2/models/x%2F..%2Fsimple/infer",
        "/v2/models/x%2f..%2fsimple/infer",
        "/v2/models/%2e%2e/infer",
        "/v2/models/%2E/infer",
        "/v2/models/a%5Cb/infer",
        "/v2/models/a%00/infer",
        "/v2/models/a%zz/infer",
        "/v2/models/a%2/infer",
        "/v2/models/a\\b/infer",
        "/v2/models/a%0d%0aX:1/infer",
        "http://127.0.0.1:8002/metrics",
        "http://evil/v2/health/ready",
        "127.0.0.1:8002",
        "*",
        "v2/health/ready",
        "",
    ],
)
def test_non_canonical_targets_are_refused_with_400(target: str) -> None:
    with pytest.raises(ProxyError) as info:
        match("POST", target)
    assert info.value.code is Code.INVALID_ARG, info.value.message


@pytest.mark.parametrize(
    ("method", "target", "code"),
    [
        ("GET", "/metrics", Code.NOT_FOUND),
        ("GET", "/v2/health", Code.NOT_FOUND),
        ("GET", "/v2/models/m/versions/abc/ready", Code.NOT_FOUND),
        ("POST", "/v2/models/m/unload", Code.NOT_FOUND),
        ("POST", "/v2/repository/models/m/delete", Code.NOT_FOUND),
        ("GET", "/v3/models/m", Code.NOT_FOUND),
        ("GET", "/v2/models/m/infer", Code.METHOD_NOT_ALLOWED),
        ("DELETE", "/v2/health/ready", Code.METHOD_NOT_ALLOWED),
        ("GET", "/v2/repository/index", Code.METHOD_NOT_ALLOWED),
        ("GET", "/v2/systemsharedmemory/register", Code.METHOD_NOT_ALLOWED),
        ("POST", "/v2/models/a b/infer", Code.INVALID_ARG),
        ("POST", "/v2/models/a%20b/infer", Code.INVALID_ARG),
        ("POST", "/v2/models/" + "m" * 256 + "/infer", Code.INVALID_ARG),
    ],
)
def test_unknown_routes_and_methods(method: str, target: str, code: Code) -> None:
    with pytest.raises(ProxyError) as info:
        match(method, target)
    assert info.value.code is code


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "a b", "é", "a\x00"])
def test_model_names_outside_the_safe_set_are_refused(name: str) -> None:
    with pytest.raises(ProxyError):
        check_model_name(name)
