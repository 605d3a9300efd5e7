import re
from pathlib import Path

import pytest

from proxy import config
from proxy.routing.config import CLASS_POLICY, CLASS_WAKE, PolicySpec
from proxy.routing.wake import WakeParams
from proxy.strict import ConfigError

MINIMAL = {"instances": [{"name": "a", "http": "http://127.0.0.1:8000"}]}


def test_defaults() -> None:
    cfg = config.parse(MINIMAL)
    assert cfg.listen.http_port == 8000 and cfg.limits.max_body_bytes == 64 * 1024 * 1024
    assert cfg.admin.enabled is False


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({}, "instances: required key is missing"),
        ({"instances": []}, "at least one Triton instance"),
        ({**MINIMAL, "limts": {}}, "limts: unknown key; did you mean 'limits'?"),
        ({**MINIMAL, "listen": {"http_port": "x"}}, "listen.http_port: expected an integer"),
        ({"instances": [{"name": "a", "http": "10.0.0.1:8000"}]}, "must be a URL"),
        ({"instances": [MINIMAL["instances"][0]] * 2}, "duplicate names a"),
        ({**MINIMAL, "admin": {"enabled": True}}, "admin.enabled needs a token"),
    ],
)
def test_errors_name_the_path(doc: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("?", r"\?").replace(".", r"\.")):
        config.parse(doc, "policy.yaml")


def test_load_file_reports_yaml_errors(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("instances: [\n")
    with pytest.raises(ConfigError, match=re.escape("bad.yaml: <root>: invalid YAML")):
        config.load_file(p)
    with pytest.raises(ConfigError, match="cannot read policy file"):
        config.load_file(tmp_path / "missing.yaml")


def test_secrets_never_appear_in_config_errors() -> None:
    base = {"instances": [{"name": "a", "http": "http://x"}]}
    mistakes = [
        {"admin": {"enabled": True, "token": 98765432101}},
        {"admin": {"enabled": True, "token": ["s3cr3t-token-value"]}},
        {"scheduling": {"api_keys": {"s3cr3t-token-value": {"clas_name": "online"}}}},
        {"scheduling": {"api_keys": {"s3cr3t-token-value": {"class_name": "nope"}}}},
        {"scheduling": {"api_keys": {"s3cr3t-token-value": {"class_name": 7}}}},
    ]
    for mistake in mistakes:
        with pytest.raises(ConfigError) as info:
            config.parse({**base, **mistake}, "policy.yaml")
        text = str(info.value)
        assert "s3cr3t" not in text and "98765432101" not in text, text
        assert "policy.yaml" in text


CLASSES = {"scheduling": {"default_class": "offline"}}
"""A ``scheduling`` section: the default three classes on."""


def test_without_classes_the_routing_defaults_stay() -> None:
    cfg = config.parse(MINIMAL)
    assert cfg.routing.policy == PolicySpec() and cfg.routing.wake == WakeParams()
    assert cfg.routing.occupancy_depth == 0.0


def test_with_classes_and_no_policy_named_the_measured_routing_is_the_default() -> None:
    cfg = config.parse({**MINIMAL, **CLASSES})
    assert cfg.routing.policy == CLASS_POLICY and cfg.routing.policy.name == "expected_finish"
    assert cfg.routing.wake == CLASS_WAKE
    # The fill from half an instance of long work on (CLASS_FILL, thirty-eighth round).
    assert (cfg.routing.occupancy_depth, cfg.routing.fill_from_load) == (0.25, 0.5)
    # The default sends only copies Triton rejects unrun: nothing runs twice.
    assert cfg.routing.wake.nudge and cfg.routing.wake.expired_copy
    assert not cfg.routing.wake.real_copy


def test_a_named_policy_keeps_every_other_routing_default() -> None:
    routing = {"policy": {"name": "least_requests"}}
    cfg = config.parse({**MINIMAL, **CLASSES, "routing": routing})
    assert cfg.routing.policy.name == "least_requests" and cfg.routing.wake == WakeParams()
    assert (cfg.routing.occupancy_depth, cfg.routing.fill_from_load) == (0.0, 0.0)


def test_a_wake_given_in_the_file_wins_over_the_class_default() -> None:
    routing = {"wake": {"enabled": False}, "stale-after-s": 2.0}
    cfg = config.parse({**MINIMAL, **CLASSES, "routing": routing})
    assert cfg.routing.policy == CLASS_POLICY
    assert cfg.routing.wake == WakeParams(enabled=False) and cfg.routing.stale_after_s == 2.0


@pytest.mark.parametrize("key", ["occupancy_depth", "occupancy-depth"])
def test_an_occupancy_depth_given_in_the_file_keeps_the_class_default_policy(key: str) -> None:
    cfg = config.parse({**MINIMAL, **CLASSES, "routing": {key: 0.5}})
    assert cfg.routing.policy == CLASS_POLICY and cfg.routing.occupancy_depth == 0.5
    assert cfg.routing.fill_from_load == 0.5  # the key not given keeps the class default
    cfg = config.parse({**MINIMAL, **CLASSES, "routing": {key: 0, "fill-from-load": 0}})
    assert (cfg.routing.occupancy_depth, cfg.routing.fill_from_load) == (0.0, 0.0)  # off


@pytest.mark.parametrize("main_classes", [True, False])
def test_a_canary_routing_section_gets_the_class_default_where_its_classes_are_on(
    main_classes: bool,
) -> None:
    canary: dict[str, object] = {"share": 0.1, "routing": {"stale_after_s": 2.0}}
    doc = {**MINIMAL, "canary": canary, **(CLASSES if main_classes else {})}
    cfg = config.parse(doc)
    assert cfg.canary is not None and cfg.canary.routing is not None
    expected = CLASS_POLICY if main_classes else PolicySpec()
    assert cfg.canary.routing.policy == expected
    # ...and with classes of its own.
    canary["scheduling"] = {"default_class": "offline"}
    cfg = config.parse(doc)
    assert cfg.canary is not None and cfg.canary.routing is not None
    assert cfg.canary.routing.policy == CLASS_POLICY
    assert cfg.routing.policy == expected
