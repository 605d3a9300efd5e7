"""The renderer's pure parts: Grafana's variable substitution and legend formats; drawing."""

from __future__ import annotations

import math
from pathlib import Path

from proxy.ops.render import PanelData, Series, draw, legend, substitute


def test_substitute_sets_rate_interval_and_variables_like_grafana() -> None:
    expr = 'rate(x{model=~"$model",class=~"${class}"}[$__rate_interval])'
    assert substitute(expr, "10s") == 'rate(x{model=~".*",class=~".*"}[10s])'
    assert substitute(expr, "1m", {"class": "realtime"}) == (
        'rate(x{model=~".*",class=~"realtime"}[1m])'
    )


def test_legend_fills_labels_and_falls_back_to_the_label_set() -> None:
    assert legend("{{class}} P99", {"class": "online"}) == "online P99"
    assert legend("", {"b": "2", "a": "1"}) == "a=1,b=2"


def test_draw_writes_a_png_with_rows_series_stats_and_notes(tmp_path: Path) -> None:
    series = Series({"class": "online"}, [(0.0, 0.1), (1.0, math.nan), (2.0, 0.2)])
    assert series.finite() == [(0.0, 0.1), (2.0, 0.2)]
    panels = [
        PanelData("Row", "", "row", {"x": 0, "y": 0, "w": 24, "h": 1}, None, [], []),
        PanelData(
            "Latency",
            "s",
            "timeseries",
            {"x": 0, "y": 1, "w": 12, "h": 8},
            ".* SLO$",
            [("online P99", series), ("online SLO", series)],
            [],
        ),
        PanelData(
            "Attainment",
            "percentunit",
            "stat",
            {"x": 12, "y": 1, "w": 12, "h": 8},
            None,
            [("online", series)],
            [],
        ),
        PanelData(
            "Empty",
            "",
            "timeseries",
            {"x": 0, "y": 9, "w": 24, "h": 8},
            None,
            [],
            ["no data"],
        ),
    ]
    out = tmp_path / "d.png"
    draw(panels, "title", out, start=0.0)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert 5_000 < out.stat().st_size < 300_000
