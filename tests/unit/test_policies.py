"""Every policy file shipped in policies/ is valid."""

from pathlib import Path

import pytest

from proxy import config
from proxy.cli import _policy_without_instances, local_policy

POLICIES = sorted((Path(__file__).resolve().parents[2] / "policies").glob("*.yaml"))


class _Server:
    name, http_url, grpc_address, metrics_url = "t0", "http://127.0.0.1:1", "127.0.0.1:2", None


@pytest.mark.parametrize("path", POLICIES, ids=[p.name for p in POLICIES])
def test_shipped_policy_loads(path: Path) -> None:
    doc = config.read_document(path)
    if "instances" in doc:
        cfg = config.load_file(path)
    else:  # a file for `triton-proxy up`, which supplies the instances
        cfg = config.parse(local_policy([_Server()], _policy_without_instances(path), (0, 0, 0)))
    assert cfg.instances


def test_policies_exist() -> None:
    assert {p.name for p in POLICIES} >= {"example.yaml", "local.yaml"}


def test_the_mixed_traffic_policy_is_the_measured_arm() -> None:
    # policies/mixed-traffic.yaml says it is issue 10's
    # `proxy_expected_finish+lane+pack90+backlog+expired+ring+adaptive+late+reserve+busy4+from5`
    # `+placed_by_rank+rspread`:
    # the same routing and scheduling (API keys aside) as that arm on case.yaml's classes.
    from proxy.bench.arms import SHIPPED_ARM, proxy_policy, resolve_arms
    from proxy.bench.scenario import load_scenario

    root = Path(__file__).resolve().parents[2]
    shipped = config.read_document(root / "policies" / "mixed-traffic.yaml")
    arm = resolve_arms(SHIPPED_ARM)[0]
    measured = proxy_policy([_Server()], arm, load_scenario(root / "benchmarks/issue10/case.yaml"))
    assert shipped["routing"] == measured["routing"]
    ours = {k: v for k, v in shipped["scheduling"].items() if k != "api_keys"}
    theirs = {k: v for k, v in measured["scheduling"].items() if k != "api_keys"}
    # The arm was measured before the floor boost (session 36); the file takes its default.
    assert theirs.pop("starved_after_s") is None
    assert ours == theirs
