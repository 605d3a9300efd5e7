"""Per arm of a ``--baseline-tree`` run (the scratch tree's arm is ``... @base``): offline's
worst 10-s window per repetition, how many fall below the floor, real-time's and online's
share within their SLOs (mean of repetitions), their P99 (median) and the floor boosts.

    python floor_summary.py RUN/report.json [RUN/scale-2/report.json ...]
"""

from __future__ import annotations

import json
import statistics
import sys

FLOOR = 36  # surge.yaml's offline floor per 10-s window


def main(paths: list[str]) -> None:
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        arms: dict[str, dict[str, list[float]]] = {}
        for rep in report["repetitions"]:
            for arm, a in rep["arms"].items():
                key = "aim" if arm.endswith("@base") else "default"
                d = arms.setdefault(key, {})
                c = a["classes"]
                windows = a["windows"]
                windows = windows.get("offline") if isinstance(windows, dict) else windows
                d.setdefault("worst", []).append(min(windows))
                d.setdefault("rt", []).append(100 * c["realtime"]["slo_attainment"])
                d.setdefault("online", []).append(100 * c["online"]["slo_attainment"])
                d.setdefault("rt_p99", []).append(c["realtime"]["p99_ms"])
                d.setdefault("online_p99", []).append(c["online"]["p99_ms"])
                d.setdefault("boosts", []).append(a.get("proxy_boosted") or 0)
        print(path)
        for key, d in arms.items():
            below = sum(w < FLOOR for w in d["worst"])
            print(
                f"  {key:8s} worst windows {[int(w) for w in d['worst']]} below {FLOOR}: {below}"
                f"  real-time {statistics.mean(d['rt']):.1f} %"
                f" (P99 {statistics.median(d['rt_p99']):.0f})"
                f"  online {statistics.mean(d['online']):.1f} %"
                f" (P99 {statistics.median(d['online_p99']):.0f})"
                f"  boosts {[int(b) for b in d['boosts']]}"
            )


if __name__ == "__main__":
    main(sys.argv[1:])
