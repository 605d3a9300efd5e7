import re
from pathlib import Path

import pytest

from proxy import config
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
