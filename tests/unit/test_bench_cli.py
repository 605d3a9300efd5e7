"""``triton-proxy bench``: arguments, arm lists, the scheduling section and the bench repository.

No fleet is started: everything here is pure, or opens only the arms that start nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import pytest

from proxy import config as config_mod
from proxy.bench import cli as bench_cli
from proxy.bench.arms import (
    CATALOG,
    CLASS_POLICIES,
    PRESETS,
    PROXY_POLICIES,
    MergedProbe,
    _banner_ports,
    build_arm,
    proxy_policy,
    resolve_arms,
    scheduling_section,
)
from proxy.bench.fleet import RepositoryError, bench_repository, set_parameters
from proxy.bench.scenario import ClassSpec, ModelSpec, Scenario, load_scenario
from proxy.cli import build_parser
from proxy.routing.config import CLASS_POLICY
from proxy.routing.registry import POLICIES
from proxy.scheduling.config import load_scheduling

ROOT = Path(__file__).resolve().parents[2]
MIXED = ROOT / "benchmarks" / "mixed.yaml"


@dataclass(frozen=True)
class FakeServer:
    name: str
    http_url: str
    metrics_url: str


SERVERS = [
    FakeServer(f"triton-{i}", f"http://127.0.0.1:{8000 + i}", f"http://127.0.0.1:{9000 + i}/m")
    for i in range(3)
]


def scenario(**classes: ClassSpec) -> Scenario:
    return Scenario(duration_s=1.0, classes=MappingProxyType(classes))


# -- arguments -----------------------------------------------------------------------------


def test_bench_is_a_subcommand_with_defaults():
    args = build_parser().parse_args(["bench"])
    assert args.func is bench_cli.cmd_bench
    assert [Path(p) for p in args.scenario] == [MIXED]
    assert args.instances == 3
    assert args.arms == "default"
    assert args.scale == [1.0]
    assert args.repetitions is None and args.duration is None
    assert args.out is None
    assert args.overhead is False and args.no_compare is False
    assert args.proxy_mode == "subprocess"


def test_bench_arguments_parse():
    args = build_parser().parse_args(
        [
            "bench",
            "--scenario",
            "benchmarks/smoke.yaml",
            "--instances",
            "2",
            "--arms",
            "quick,haproxy_session",
            "--repetitions",
            "5",
            "--duration",
            "12.5",
            "--scale",
            "0.5",
            "1",
            "1.5",
            "--out",
            "bench-results/x",
            "--overhead",
            "--proxy-mode",
            "inprocess",
        ]
    )
    assert args.scenario == ["benchmarks/smoke.yaml"]
    assert args.instances == 2 and args.repetitions == 5 and args.duration == 12.5
    assert args.scale == [0.5, 1.0, 1.5]
    assert args.out == "bench-results/x" and args.overhead
    assert args.proxy_mode == "inprocess"


@pytest.mark.parametrize("bad", [["--proxy-mode", "thread"], ["--scale"], ["--instances", "x"]])
def test_bench_rejects_bad_arguments(bad):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", *bad])


def test_list_arms_prints_catalog_and_presets(capsys):
    args = build_parser().parse_args(["bench", "--list-arms"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    for name in [*CATALOG, *PRESETS]:
        assert name in out


def test_bad_arm_name_is_a_usage_error(capsys):
    args = build_parser().parse_args(["bench", "--arms", "round_robin,nginx"])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "unknown arm 'nginx'" in err and "haproxy_leastconn" in err


def test_scenario_overrides_and_helpers():
    sc = bench_cli.bench_scenario(MIXED, repetitions=2, duration_s=7.0)
    assert sc.repetitions == 2 and sc.duration_s == 7.0
    assert bench_cli.bench_scenario(MIXED) == load_scenario(MIXED)
    assert bench_cli.parse_rates("100, 200,400") == (100.0, 200.0, 400.0)
    for bad in ("", "100,x", "0,10"):
        with pytest.raises(ValueError):
            bench_cli.parse_rates(bad)
    out = Path("o")
    assert bench_cli.scale_dir(out, 1.0, [1.0]) == out
    assert bench_cli.scale_dir(out, 1.5, [1.0, 1.5]) == out / "scale-1.5"
    assert bench_cli.models_needed(sc, overhead=False) == ["accel_sim"]
    assert bench_cli.models_needed(sc, overhead=True) == ["accel_sim", "simple"]
    estimate = bench_cli.estimate_sweep_seconds(sc, arms=2, scales=[1, 1, 1], per_arm_s=3.0)
    assert estimate == pytest.approx(bench_cli.FLEET_START_S + 3 * 2 * 2 * (sc.horizon_s + 3.0))


def test_device_note_names_the_emulated_device():
    sc = load_scenario(MIXED)
    note = bench_cli.device_note(sc)
    assert "accel_sim" in note
    for key, value in sc.model.parameters.items():
        assert f"{key}={value:g}" in note


# -- arm lists -----------------------------------------------------------------------------


def test_catalog_covers_the_issue_arms():
    assert {"round_robin", "rr_priority"} <= set(CATALOG)
    assert {"haproxy_leastconn", "haproxy_random2", "haproxy_session"} <= set(CATALOG)
    for p in PROXY_POLICIES:
        assert p in POLICIES, f"{p} is not a routing policy"
        assert CATALOG[f"proxy_{p}"].policy == p and not CATALOG[f"proxy_{p}"].classes
    for p in CLASS_POLICIES:
        assert CATALOG[f"proxy_{p}+classes"].classes
    assert CATALOG["rr_priority"].priority and not CATALOG["round_robin"].priority
    assert PRESETS["all"] == tuple(CATALOG)
    for preset, names in PRESETS.items():
        assert set(names) <= set(CATALOG), preset


@pytest.mark.parametrize(
    ("spec", "names"),
    [
        ("round_robin", ["round_robin"]),
        (
            "quick",
            ["round_robin", "rr_priority", "proxy_least_requests+classes"],
        ),
        (
            "rr_priority, quick ,",
            ["rr_priority", "round_robin", "proxy_least_requests+classes"],
        ),
        ("default", list(PRESETS["default"])),
        ("baselines,proxy", list(PRESETS["baselines"]) + list(PRESETS["proxy"])),
        ("all,round_robin", list(CATALOG)),
    ],
)
def test_resolve_arms(spec, names):
    assert [p.name for p in resolve_arms(spec)] == names


def test_default_preset_compares_against_round_robin_and_has_classes():
    plans = resolve_arms("default")
    assert bench_cli.baseline_name(plans) == "round_robin"
    assert any(p.kind == "haproxy" for p in plans)
    assert any(p.classes for p in plans) and any(p.kind == "proxy" and not p.classes for p in plans)
    assert bench_cli.baseline_name(resolve_arms("proxy")) == "proxy_round_robin"


@pytest.mark.parametrize("spec", ["", " , ", "nope", "round_robin,nope"])
def test_resolve_arms_rejects(spec):
    with pytest.raises(ValueError):
        resolve_arms(spec)


def test_build_arms_starts_nothing_until_opened(tmp_path):
    sc = load_scenario(MIXED)
    arms = [
        build_arm(p, SERVERS, sc, model=sc.model, workdir=tmp_path) for p in resolve_arms("all")
    ]
    assert [a.name for a in arms] == list(CATALOG)
    assert not any(tmp_path.iterdir())
    proxies = [a for a, p in zip(arms, CATALOG.values(), strict=True) if p.kind == "proxy"]
    assert all(a.probe is not None for a in proxies)
    named = build_arm(
        CATALOG["proxy_p2c"],
        SERVERS,
        sc,
        model=sc.model,
        workdir=tmp_path,
        name="x",
        mode="inprocess",
    )
    assert named.name == "x" and "inprocess" in named.description


async def test_direct_arms_target_every_server(tmp_path):
    sc = load_scenario(MIXED)
    for name, priority in (("round_robin", False), ("rr_priority", True)):
        arm = build_arm(CATALOG[name], SERVERS, sc, model=sc.model, workdir=tmp_path)
        async with arm.open() as target:
            assert target.urls == tuple(s.http_url for s in SERVERS)
            assert target.instance_names == tuple(s.name for s in SERVERS)
            assert target.priority is priority


# -- scheduling section --------------------------------------------------------------------


def test_scheduling_section_from_mixed_scenario():
    sc = load_scenario(MIXED)
    section = scheduling_section(sc)
    ranked = sorted(sc.class_names, key=lambda n: sc.classes[n].slo_p99_ms or float("inf"))
    assert list(section["classes"]) == ranked
    for rank, name in enumerate(ranked):
        entry = section["classes"][name]
        assert entry["rank"] == rank
        assert entry["triton_priority"] == sc.classes[name].triton_priority
        assert entry["slo_p99_ms"] == sc.classes[name].slo_p99_ms
    assert section["api_keys"] == {sc.classes[n].api_key: {"class_name": n} for n in sc.class_names}
    assert section["default_class"] == ranked[-1]
    cfg = load_scheduling(section)  # valid as the proxy reads it
    assert cfg.classes[ranked[0]].rank == 0
    assert cfg.triton_priority_for(ranked[0], 3) == sc.classes[ranked[0]].triton_priority


def test_scheduling_section_ranks_ties_and_classes_without_slo():
    sc = scenario(
        bulk=ClassSpec(rate_rps=1, triton_priority=3),
        b=ClassSpec(rate_rps=1, slo_p99_ms=100, triton_priority=2, api_key="kb"),
        a=ClassSpec(rate_rps=1, slo_p99_ms=100, triton_priority=0, api_key="ka"),
        c=ClassSpec(rate_rps=1, slo_p99_ms=100, triton_priority=2),
        fast=ClassSpec(rate_rps=1, slo_p99_ms=20),
    )
    section = scheduling_section(sc)
    # SLO first; equal SLO: priority 2 before unset (0); then file order; no SLO last.
    assert list(section["classes"]) == ["fast", "b", "c", "a", "bulk"]
    assert "slo_p99_ms" not in section["classes"]["bulk"]
    assert not any("min_share" in c for c in section["classes"].values())
    assert section["api_keys"] == {"kb": {"class_name": "b"}, "ka": {"class_name": "a"}}
    assert section["default_class"] == "bulk"
    load_scheduling(section)


def test_scheduling_section_carries_a_min_share():
    sc = scenario(
        rt=ClassSpec(rate_rps=1, slo_p99_ms=100), bulk=ClassSpec(rate_rps=1, min_share=0.1)
    )
    section = scheduling_section(sc)
    assert section["classes"]["bulk"]["min_share"] == 0.1
    assert load_scheduling(section).classes["bulk"].min_share == 0.1


def test_scheduling_section_rejects_shared_api_keys():
    sc = scenario(a=ClassSpec(rate_rps=1, api_key="same"), b=ClassSpec(rate_rps=1, api_key="same"))
    with pytest.raises(ValueError, match="share an api_key"):
        scheduling_section(sc)


@pytest.mark.parametrize("name", [n for n, p in CATALOG.items() if p.kind == "proxy"])
def test_proxy_policy_documents_parse(name):
    sc = load_scenario(MIXED)
    plan = CATALOG[name]
    doc = proxy_policy(SERVERS, plan, sc)
    cfg = config_mod.parse(doc, "<test>")
    assert [i.name for i in cfg.instances] == [s.name for s in SERVERS]
    assert all(i.grpc is None for i in cfg.instances)  # HTTP only: no gRPC frontend to run
    # No policy named: the proxy's default with classes.
    assert cfg.routing.policy.name == (plan.policy or CLASS_POLICY.name)
    assert cfg.listen.http_port == 0 and cfg.listen.host == "127.0.0.1"
    if plan.classes:
        assert cfg.scheduling is not None
        assert set(cfg.scheduling.classes) == set(sc.class_names)
    else:
        assert cfg.scheduling is None


def test_proxy_policy_refuses_non_proxy_arms():
    with pytest.raises(ValueError):
        proxy_policy(SERVERS, CATALOG["round_robin"], None)
    with pytest.raises(ValueError):
        proxy_policy(SERVERS, CATALOG["proxy_least_requests+classes"], None)


def test_banner_ports():
    banner = (
        "2026 INFO proxy.app: gRPC frontend off\n"
        "triton-proxy ready: HTTP localhost:41234\n"
        "  metrics http://localhost:41235/metrics\n"
    )
    assert _banner_ports(banner) == (41234, 41235)
    assert _banner_ports("triton-proxy ready: HTTP localhost:5\n") == (5, None)
    assert _banner_ports("starting...\n") is None


class FakeProbe:
    def __init__(self, values: Mapping[str, float]) -> None:
        self.values = values
        self.closed = False

    async def sample(self) -> Mapping[str, float]:
        return self.values

    async def aclose(self) -> None:
        self.closed = True


async def test_merged_probe_suffixes_names():
    a, b = FakeProbe({"t0": 1.0}), FakeProbe({"t0": 2.0, "t1": 3.0})
    probe = MergedProbe([(a, " queued"), (b, " proxy in flight")])
    assert await probe.sample() == {
        "t0 queued": 1.0,
        "t0 proxy in flight": 2.0,
        "t1 proxy in flight": 3.0,
    }
    await probe.aclose()
    assert a.closed and b.closed


# -- the bench repository ------------------------------------------------------------------

PBTXT = """name: "m"
parameters {
  key: "base_ms"
  value: { string_value: "3" }
}
parameters { key: "per_token_us" value: { string_value: "2" } }
"""


def test_set_parameters_rewrites_only_the_named_values():
    out = set_parameters(PBTXT, {"base_ms": 5.0, "per_token_us": 12.5})
    assert 'string_value: "5"' in out and 'string_value: "12.5"' in out
    assert out.replace('"5"', '"3"').replace('"12.5"', '"2"') == PBTXT
    assert set_parameters(PBTXT, {}) == PBTXT


def test_set_parameters_refuses_unknown_keys_and_quotes():
    with pytest.raises(RepositoryError, match=r"no parameter .base.*base_ms, per_token_us"):
        set_parameters(PBTXT, {"base": 1.0})
    with pytest.raises(RepositoryError, match="quotes"):
        set_parameters(PBTXT, {"base_ms": 'x"y'})


def test_bench_repository_copies_models_with_overrides(tmp_path):
    dest = tmp_path / "repo"
    (dest / "stale").mkdir(parents=True)
    bench_repository(
        ROOT / "model_repository",
        dest,
        ["accel_sim", "simple"],
        {"accel_sim": {"base_ms": 7, "per_token_us": 9}},
    )
    assert sorted(p.name for p in dest.iterdir()) == ["accel_sim", "simple"]
    cfg = (dest / "accel_sim" / "config.pbtxt").read_text()
    assert 'key: "base_ms"\n  value: { string_value: "7" }' in cfg
    assert 'key: "per_token_us"\n  value: { string_value: "9" }' in cfg
    assert (dest / "accel_sim" / "1" / "model.py").is_file()
    original = (ROOT / "model_repository" / "simple" / "config.pbtxt").read_text()
    assert (dest / "simple" / "config.pbtxt").read_text() == original


def test_bench_repository_errors(tmp_path):
    src = ROOT / "model_repository"
    with pytest.raises(RepositoryError, match="not served"):
        bench_repository(src, tmp_path / "a", ["simple"], {"accel_sim": {"base_ms": 1}})
    with pytest.raises(RepositoryError, match="not a model folder"):
        bench_repository(src, tmp_path / "b", ["no_such_model"])
    with pytest.raises(RepositoryError, match="accel_sim: the model has no parameter"):
        bench_repository(src, tmp_path / "c", ["accel_sim"], {"accel_sim": {"nope": 1}})


def test_mixed_scenario_device_parameters_exist_in_accel_sim():
    sc = load_scenario(MIXED)
    assert sc.model.name == "accel_sim" and sc.model.parameters
    text = (ROOT / "model_repository" / "accel_sim" / "config.pbtxt").read_text()
    set_parameters(text, sc.model.parameters)  # raises if the scenario names a missing one


def test_overhead_model_sends_both_simple_inputs():
    from proxy.bench.runner import RequestEncoder
    from proxy.bench.scenario import Arrival

    model = dataclasses.replace(bench_cli.OVERHEAD_MODEL, encoding="json")
    enc = RequestEncoder(model, {"small": ClassSpec(rate_rps=1)}, priority=False)
    body, _ = enc.encode(Arrival(0, 0.0, "small", 16, None, False))
    import json

    doc = json.loads(body)
    assert [t["name"] for t in doc["inputs"]] == ["INPUT0", "INPUT1"]
    assert all(t["shape"] == [1, 16] and t["datatype"] == "INT32" for t in doc["inputs"])
    binary = RequestEncoder(bench_cli.OVERHEAD_MODEL, {"small": ClassSpec(rate_rps=1)}, False)
    body, headers = binary.encode(Arrival(0, 0.0, "small", 16, None, False))
    header_len = int(headers["Inference-Header-Content-Length"])
    assert len(body) == header_len + 2 * 16 * 4


def test_model_spec_round_trips_parameters():
    spec = ModelSpec(parameters=MappingProxyType({"base_ms": 5.0}), extra_inputs=("B",))
    d = spec.to_dict()
    assert d["parameters"] == {"base_ms": 5.0} and d["extra_inputs"] == ["B"]


# -- CPU accounting ------------------------------------------------------------------------


def test_parse_stat_survives_odd_process_names():
    from proxy.bench.cpu import _TICK, parse_stat

    fields = ["S", "7", "9", "9", "0", "-1", "0", "0", "0", "0", "0", "250", "50"]
    st = parse_stat("123 (a) (b c) " + " ".join(fields) + " 20 0 1 0")
    assert (st.pid, st.ppid, st.pgrp) == (123, 7, 9)
    assert st.cpu_s == pytest.approx(300 / _TICK)


def test_attribute_and_cpu_use():
    from proxy.bench.cpu import ProcStat, attribute, cpu_use

    procs = [
        ProcStat(10, 1, 10, 2.0),  # the generator
        ProcStat(11, 10, 11, 1.0),  # its child: the arm's process
        ProcStat(20, 10, 20, 3.0),  # a Triton server (own group) and its stub
        ProcStat(21, 20, 20, 4.0),
        ProcStat(30, 1, 30, 9.0),  # someone else
        ProcStat(12, 11, 11, 0.5),  # the arm's own children (proxy workers)
        ProcStat(13, 12, 11, 0.25),
    ]
    assert attribute(procs, 10, {20}) == {"generator": 2.0, "arm": 1.75, "triton": 7.0}
    use = cpu_use(
        "x",
        (0.0, 100.0, {"generator": 1.0, "arm": 0.0, "triton": 2.0}),
        (10.0, 115.0, {"generator": 3.0, "arm": 1.0, "triton": 9.0}),
    )
    assert use.cores == {"generator": 0.2, "arm": 0.1, "triton": 0.7, "other": pytest.approx(0.5)}
    assert use.machine_cores == 1.5


async def test_cpu_meter_wraps_an_arm():
    from proxy.bench.compare import ArmSpec
    from proxy.bench.cpu import CpuMeter

    meter = CpuMeter(lambda: set())
    arm = meter.wrap(ArmSpec.direct("d", ["http://127.0.0.1:1"]))
    assert arm.name == "d"
    for _ in range(2):
        async with arm.open() as spec:
            assert spec.urls == ("http://127.0.0.1:1",)
    assert [r.arm for r in meter.runs] == ["d", "d"]
    assert set(meter.summary()["d"]) == {"generator", "arm", "triton", "other", "machine"}
    assert "d" in meter.render()


# -- publishing ----------------------------------------------------------------------------


def test_publish_strips_histograms_and_work(tmp_path):
    import json

    from proxy.bench.publish import DROPPED, publish, strip_histograms

    report = {
        "summary": {"a": {"classes": {"x": {"pooled": {"p99_ms": 3.0}}}}},
        "repetitions": [
            {"arms": {"a": {"classes": {"x": {"p99_ms": 3.0, "latency_us": {"buckets": [1]}}}}}}
        ],
    }
    small = strip_histograms(report)
    assert small["repetitions"][0]["arms"]["a"]["classes"]["x"] == {"p99_ms": 3.0}
    assert small["summary"] == report["summary"]
    assert "latency_us" in report["repetitions"][0]["arms"]["a"]["classes"]["x"]  # a copy
    src = tmp_path / "run"
    (src / "work" / "logs").mkdir(parents=True)
    (src / "work" / "logs" / "t.txt").write_text("log")
    (src / "scale-1.5").mkdir()
    (src / "scale-1.5" / "report.json").write_text(json.dumps(report))
    (src / "report.txt").write_text("table")
    (src / "run.json").write_text('{"command": "x"}')
    (src / "other.bin").write_bytes(b"\0")
    (src / "case" / "work" / "logs").mkdir(parents=True)  # several scenarios: OUT/<stem>/work
    (src / "case" / "work" / "logs" / "t.txt").write_text("log")
    (src / "case" / "sweep.txt").write_text("sweep")
    files = publish(src, tmp_path / "docs")
    rel = sorted(str(f.relative_to(tmp_path / "docs")) for f in files)
    assert rel == ["case/sweep.txt", "report.txt", "run.json", "scale-1.5/report.json"]
    doc = json.loads((tmp_path / "docs" / "scale-1.5" / "report.json").read_text())
    assert doc["published"] == DROPPED and "latency_us" not in json.dumps(doc)
    assert json.loads((tmp_path / "docs" / "run.json").read_text()) == {"command": "x"}


async def test_connection_limit_wraps_any_arm(tmp_path):
    from proxy.bench.arms import with_connection_limit

    sc = load_scenario(MIXED)
    arm = build_arm(CATALOG["rr_priority"], SERVERS, sc, model=sc.model, workdir=tmp_path)
    limited = with_connection_limit(arm, 8000)
    async with limited.open() as spec:
        assert spec.connection_limit == 8000 and spec.priority
    assert build_parser().parse_args(["bench"]).connections == 8000
    with pytest.raises(ValueError):
        with_connection_limit(arm, 0)
