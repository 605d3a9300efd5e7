"""Classification from headers / gRPC metadata: keys map to classes, no self-promotion."""

from __future__ import annotations

import hashlib

import pytest

from proxy.scheduling.classify import Classifier, header
from proxy.scheduling.config import load_scheduling

HASHED = "sha256:" + hashlib.sha256(b"hashed-key").hexdigest()

CONFIG = load_scheduling(
    {
        "api_keys": {
            "rt-key": {"class_name": "realtime"},
            "gateway-key": {"class_name": "online", "allow_class_header": True},
            "batch-key": {"class_name": "offline"},
            HASHED: {"class_name": "realtime"},
        }
    }
)

CASES: list[tuple[str, dict[str, str], str]] = [
    ("no headers", {}, "online"),
    ("unknown key", {"Authorization": "Bearer nope"}, "online"),
    ("known key", {"authorization": "Bearer rt-key"}, "realtime"),
    ("scheme is case-insensitive", {"AUTHORIZATION": "bearer  rt-key "}, "realtime"),
    ("not a bearer token", {"authorization": "Basic rt-key"}, "online"),
    ("empty token", {"authorization": "Bearer "}, "online"),
    ("hashed key", {"authorization": "Bearer hashed-key"}, "realtime"),
    ("the digest itself is not a key", {"authorization": f"Bearer {HASHED}"}, "online"),
    # No self-promotion: the header counts only for a key that allows it.
    ("anonymous header", {"x-triton-proxy-class": "realtime"}, "online"),
    (
        "unknown key with header",
        {"authorization": "Bearer nope", "x-triton-proxy-class": "realtime"},
        "online",
    ),
    (
        "key without header right",
        {"authorization": "Bearer batch-key", "X-Triton-Proxy-Class": "realtime"},
        "offline",
    ),
    (
        "trusted key picks up",
        {"authorization": "Bearer gateway-key", "X-Triton-Proxy-Class": "realtime"},
        "realtime",
    ),
    (
        "trusted key picks down",
        {"authorization": "Bearer gateway-key", "x-triton-proxy-class": "offline"},
        "offline",
    ),
    (
        "trusted key, unknown class",
        {"authorization": "Bearer gateway-key", "x-triton-proxy-class": "vip"},
        "online",
    ),
    ("trusted key, no header", {"authorization": "Bearer gateway-key"}, "online"),
]


@pytest.mark.parametrize(("headers", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_classify(headers: dict[str, str], expected: str) -> None:
    assert Classifier(CONFIG).classify(headers) == expected


def test_named_key_header_takes_the_bare_value() -> None:
    config = load_scheduling(
        {"api_key_header": "x-api-key", "api_keys": {"k": {"class_name": "offline"}}}
    )
    classifier = Classifier(config)
    assert classifier.classify({"X-Api-Key": "k"}) == "offline"
    assert classifier.classify({"authorization": "Bearer k"}) == "online"


def test_grpc_metadata_shape() -> None:
    # grpc.aio metadata arrives as lower-case (key, value) pairs; a dict of them classifies.
    metadata = (("authorization", "Bearer rt-key"), ("user-agent", "grpc-python"))
    assert Classifier(CONFIG).classify(dict(metadata)) == "realtime"


def test_header_lookup_is_case_insensitive() -> None:
    assert header({"X-Foo": "1"}, "x-foo") == "1"
    assert header({"x-foo": "1"}, "X-FOO") == "1"
    assert header({}, "x-foo") is None
