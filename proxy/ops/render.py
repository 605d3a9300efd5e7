"""A dashboard's panels drawn from Prometheus data into a PNG, for when Grafana is not at hand.

    python -m proxy.ops.render --prometheus http://localhost:9090 --dashboard overview \\
        --since 15m --out overview.png

Each panel's queries run through Prometheus' HTTP API (``/api/v1/query_range``) with the
dashboard variables set to "All" (or to ``--var name=regex``) and ``$__rate_interval`` set to
``--rate-interval``; the panels keep their Grafana layout (``gridPos``), titles, legends, units
and dashed series. A panel on Triton's GPU metrics says why it is empty on a machine without a
GPU, and any other panel whose queries returned nothing says "no data".
Needs matplotlib (the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proxy.ops import dashboards


class PromQLError(RuntimeError):
    """Prometheus refused a query (it does not parse, or failed to evaluate)."""


@dataclass(frozen=True)
class Series:
    labels: dict[str, str]
    points: list[tuple[float, float]]

    def finite(self) -> list[tuple[float, float]]:
        return [(t, v) for t, v in self.points if math.isfinite(v)]


def substitute(expr: str, rate_interval: str, variables: Mapping[str, str] | None = None) -> str:
    """The query as Grafana would send it: ``$__rate_interval`` and ``$var`` / ``${var}``
    replaced; a variable not given is "All" (``.*``)."""
    out = expr.replace("$__rate_interval", rate_interval)
    values = dict(variables or {})

    def value(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        return values.get(name, ".*")

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, out)


class Prometheus:
    """The few calls of Prometheus' HTTP API that the renderer and the tests need."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def _get(self, path: str, params: Mapping[str, str]) -> Any:
        query = urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=self.timeout_s) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
            raise PromQLError(
                f"{body.get('errorType', exc.code)}: {body.get('error', '')}"
            ) from exc
        if body.get("status") != "success":
            raise PromQLError(f"{body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[Series]:
        data = self._get(
            "/api/v1/query_range",
            {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"},
        )
        return [
            Series(dict(r["metric"]), [(float(t), float(v)) for t, v in r["values"]])
            for r in data["result"]
        ]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return list(self._get("/api/v1/query", {"query": expr})["result"])


def legend(fmt: str, labels: Mapping[str, str]) -> str:
    text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)
    return text.strip() or ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


_UNITS = {"reqps": "req/s", "percentunit": "fraction", "bytes": "bytes"}


@dataclass
class PanelData:
    title: str
    unit: str
    kind: str
    grid: dict[str, int]
    dashed: str | None
    lines: list[tuple[str, Series]]
    notes: list[str]


def collect(
    prom: Prometheus,
    dashboard: Mapping[str, Any],
    start: float,
    end: float,
    step: float,
    rate_interval: str,
    variables: Mapping[str, str] | None = None,
) -> list[PanelData]:
    """Every panel's series over [start, end]; notes say what is pending or empty."""
    panels = []
    for panel in dashboard["panels"]:
        dashed = None
        for override in panel.get("fieldConfig", {}).get("overrides", []):
            if override["matcher"]["id"] == "byRegexp":
                dashed = override["matcher"]["options"]
        data = PanelData(
            panel["title"],
            panel.get("fieldConfig", {}).get("defaults", {}).get("unit", ""),
            panel["type"],
            panel["gridPos"],
            dashed,
            [],
            [],
        )
        for target in panel.get("targets", []):
            expr = substitute(target["expr"], rate_interval, variables)
            series = prom.query_range(expr, start, end, step)
            for s in series:
                if s.finite():
                    data.lines.append((legend(target.get("legendFormat", ""), s.labels), s))
            why = dashboards.requirement(target["expr"])
            if why == "gpu" and not any(s.finite() for s in series):
                data.notes.append("no GPU: Triton exports nv_gpu_* only where it sees one")
        if panel["type"] != "row" and not data.lines and not data.notes:
            data.notes.append("no data")
        panels.append(data)
    return panels


def draw(panels: Sequence[PanelData], title: str, out: Path, start: float, dpi: int = 72) -> None:
    """Lays the panels out as Grafana does (24 columns) and writes a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bottom = max(p.grid["y"] + p.grid["h"] for p in panels)
    height = bottom * 0.4 + 0.8
    fig = plt.figure(figsize=(16, height))
    fig.suptitle(title, fontsize=14, x=0.01, ha="left")
    grid = fig.add_gridspec(
        bottom, 24, hspace=2.0, wspace=1.2, left=0.04, right=0.99, bottom=0.5 / height,
        top=1 - 0.6 / height,
    )  # fmt: skip
    for p in panels:
        g = p.grid
        if p.kind == "row":
            ax = fig.add_subplot(grid[g["y"], :])
            ax.axis("off")
            ax.text(0, 0.2, p.title, fontsize=12, fontweight="bold", transform=ax.transAxes)
            continue
        ax = fig.add_subplot(grid[g["y"] + 0 : g["y"] + g["h"], g["x"] : g["x"] + g["w"]])
        ax.set_title(p.title, fontsize=9, loc="left")
        ax.tick_params(labelsize=7)
        if p.kind == "stat":
            ax.axis("off")
            lines = [
                f"{name}: {_fmt(s.finite()[-1][1], p.unit)}" for name, s in p.lines if s.finite()
            ]
            ax.text(
                0.5,
                0.5,
                "\n".join(lines + p.notes) or "no data",
                ha="center",
                va="center",
                fontsize=13 if len(lines) < 4 else 10,
                transform=ax.transAxes,
            )
            continue
        scale, unit = (1000.0, "ms") if p.unit == "s" else (1.0, _UNITS.get(p.unit, ""))
        for name, s in p.lines:
            pts = s.finite()
            style = "--" if p.dashed and re.fullmatch(p.dashed, name) else "-"
            xs, ys = [t - start for t, _ in pts], [v * scale for _, v in pts]
            ax.plot(xs, ys, style, lw=1.2, label=name)
        ax.set_ylabel(unit, fontsize=7)
        positive = [v for _, s in p.lines for _, v in s.finite() if v > 0]
        if p.unit == "s" and positive and max(positive) / min(positive) > 20:
            ax.set_yscale("log")  # tails and SLO lines span decades
        if p.lines:
            ax.legend(fontsize=6, loc="upper left", ncol=2 if len(p.lines) > 6 else 1)
        if p.notes:
            ax.text(
                0.5,
                0.5,
                "\n".join(p.notes),
                ha="center",
                va="center",
                fontsize=9,
                color="#a05000",
                transform=ax.transAxes,
                wrap=True,
            )
    fig.text(0.99, 0.005, "x: seconds from the start of the range", fontsize=7, ha="right")
    fig.savefig(out, dpi=dpi)
    plt.close(fig)


def _fmt(value: float, unit: str) -> str:
    if unit == "percentunit":
        return f"{value * 100:.1f}%"
    if unit == "s":
        return f"{value * 1000:.1f} ms"
    return f"{value:.3g}"


def render(
    prom: Prometheus,
    dashboard_file: Path,
    out: Path,
    start: float,
    end: float,
    *,
    step: float = 1.0,
    rate_interval: str = "1m",
    variables: Mapping[str, str] | None = None,
) -> list[PanelData]:
    doc = json.loads(dashboard_file.read_text())
    panels = collect(prom, doc, start, end, step, rate_interval, variables)
    draw(panels, doc["title"], out, start)
    return panels


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m proxy.ops.render", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--prometheus", default="http://localhost:9090")
    parser.add_argument(
        "--dashboard",
        default="overview",
        help=f"one of {', '.join(dashboards.DASHBOARDS)} or a JSON file",
    )
    parser.add_argument("--since", default="15m", help="how far back: 90s, 15m, 2h")
    parser.add_argument("--rate-interval", default="1m", help="what $__rate_interval becomes")
    parser.add_argument(
        "--var", action="append", default=[], help="name=regex, e.g. class=realtime"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    path = Path(args.dashboard)
    if not path.exists():
        path = dashboards.DASHBOARD_DIR / f"{args.dashboard}.json"
    since = _seconds(args.since)
    end = time.time()
    variables = dict(v.split("=", 1) for v in args.var)
    step = max(1.0, since / 300)
    panels = render(
        Prometheus(args.prometheus), path, args.out, end - since, end,
        step=step, rate_interval=args.rate_interval, variables=variables,
    )  # fmt: skip
    for p in panels:
        if p.notes:
            print(f"{p.title}: {'; '.join(p.notes)}")
    print(args.out)
    return 0


def _seconds(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smh]?)", text)
    if m is None:
        raise SystemExit(f"--since: expected e.g. 90s, 15m or 2h, got {text!r}")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


if __name__ == "__main__":
    raise SystemExit(main())
