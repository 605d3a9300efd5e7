"""The proxy's ``/metrics`` page: Prometheus text format 0.0.4, byte for byte what
``prometheus_client.generate_latest`` writes, in a fraction of its time.

Why not ``generate_latest``: the proxy renders its page in its event loop, so every request in
flight waits while it does. On a page like the issue 10 benchmark's (3 instances, 3 classes,
38 KB, 333 samples; ``benchmarks/metrics_render.py``) it took 3.5 ms on a quiet machine (about
5 ms on a busy one), and cProfile put 60 % of that in formatting each sample's labels again at
every scrape (sort, validate each label name with a regular expression, escape each value) and
30 % in collecting: a ``Sample`` tuple and a label dict per sample, and each histogram bucket's
bound formatted as text again. This renders the same page in 0.67 ms (docs/benchmarks.md,
"Session 18"). So here:

- each series' text up to its value (``name{a="x",le="0.5"} ``) is kept from one scrape to
  the next, so only values are formatted per scrape. Label values come from model names and
  config, so the texts kept are bounded (``max_series`` per metric, as
  :class:`proxy.telemetry.Children`); past the bound a series' text is built at every scrape;
- Counter and Histogram children are read directly (their value objects, under
  prometheus_client's own locks) rather than through ``collect()``. This reads
  prometheus_client's private attributes (``_metrics``, ``_labelnames``, ``_value``,
  ``_buckets``, ``_sum``, ``_created``); ``tests/unit/test_exposition.py`` compares the page
  with ``generate_latest``'s byte for byte, so a change there fails a test, not a scrape;
- any other collector (the fleet's gauges, built at scrape time) goes through ``collect()`` and
  the same formatting, without the kept texts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.exposition import escape_label_name, escape_metric_name
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString as _float_to_go_string

MAX_SERIES = 4096
"""Series kept per metric: texts here, label children in :class:`proxy.telemetry.Children`."""

_SEPARATE = ("_created", "_gcount", "_gsum")
"""Sample suffixes ``generate_latest`` moves to a gauge family of their own after the
family's other samples (OpenMetrics-only series, in the older text format)."""

_number: Callable[[float], str] = _float_to_go_string
"""A value as the text format writes it (prometheus_client's function: Go's float format)."""

# Names come from code and config (few); the bound is only a guard.
_metric_name = functools.lru_cache(maxsize=1024)(escape_metric_name)
_label_name = functools.lru_cache(maxsize=1024)(escape_label_name)


def _escape_value(value: str) -> str:
    """A label value as the text format quotes it (what prometheus_client does)."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    """``{a="x",b="y"}`` for the label pairs, sorted by name; empty without labels."""
    inner = ",".join(f'{_label_name(k)}="{_escape_value(v)}"' for k, v in sorted(pairs))
    return f"{{{inner}}}" if inner else ""


def _head(name: str, documentation: str, kind: str) -> str:
    shown = _metric_name(name)
    doc = documentation.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {shown} {doc}\n# TYPE {shown} {kind}\n"


_SHOWN_TYPES = {
    "info": "gauge",
    "stateset": "gauge",
    "gaugehistogram": "histogram",
    "unknown": "untyped",
}


def _family_head(metric: Metric) -> str:
    """The family's HELP and TYPE lines, its name and type as the text format 0.0.4 shows
    them."""
    name, kind = metric.name, metric.type
    if kind == "counter":
        name += "_total"
    elif kind == "info":
        name += "_info"
    return _head(name, metric.documentation, _SHOWN_TYPES.get(kind, kind))


def _family(out: list[str], metric: Metric) -> None:
    """Append one family's lines, as ``generate_latest`` writes them."""
    out.append(_family_head(metric))
    separate: dict[str, list[str]] = {}
    for s in metric.samples:
        series = f"{_metric_name(s.name)}{_labels(s.labels.items())}"
        stamp = "" if s.timestamp is None else f" {int(float(s.timestamp) * 1000):d}"
        line = f"{series} {_number(s.value)}{stamp}\n"
        for suffix in _SEPARATE:
            if s.name == metric.name + suffix:
                separate.setdefault(suffix, []).append(line)
                break
        else:
            out.append(line)
    for suffix, lines in sorted(separate.items()):
        out.append(_head(metric.name + suffix, metric.documentation, "gauge"))
        out.extend(lines)


def render_families(families: Iterable[Metric]) -> bytes:
    """The page of these families (no texts kept: for pages rendered once)."""
    out: list[str] = []
    for metric in families:
        _family(out, metric)
    return "".join(out).encode()


@dataclass(frozen=True, slots=True)
class _SeriesText:
    """One labelled child's texts up to the value: its samples but ``_created``, in the order
    of ``_child_samples()``, and its ``_created`` sample's (None when not exported)."""

    samples: tuple[str, ...]
    created: str | None


def _counter_values(child: Any) -> list[float]:
    return [child._value.get()]


def _histogram_values(child: Any) -> list[float]:
    """What ``Histogram._child_samples()`` yields but ``_created``: the cumulative bucket
    counts, the count, and the sum (prometheus_client leaves the sum out when a bucket bound
    is negative)."""
    values = list(accumulate((b.get() for b in child._buckets), initial=0.0))[1:]
    values.append(values[-1])
    if child._upper_bounds[0] >= 0:
        values.append(child._sum.get())
    return values


class _WrapperPage:
    """The lines of one Counter or Histogram, with each child's texts kept."""

    def __init__(self, metric: Counter | Histogram, max_series: int) -> None:
        [family] = metric.describe()
        self._metric = metric
        self._name = family.name
        self._head = _family_head(family)
        self._created_head = _head(family.name + "_created", family.documentation, "gauge")
        self._values = _histogram_values if isinstance(metric, Histogram) else _counter_values
        self._texts: dict[tuple[str, ...], _SeriesText] = {}
        self._max = max_series

    def render(self, out: list[str]) -> None:
        metric: Any = self._metric
        if metric._labelnames:
            with metric._lock:
                children = list(metric._metrics.items())
        else:
            children = [((), metric)]
        out.append(self._head)
        created: list[str] = []
        for labelvalues, child in children:
            texts = self._texts.get(labelvalues) or self._series(labelvalues, child)
            for text, value in zip(texts.samples, self._values(child), strict=True):
                out.append(f"{text}{_number(value)}\n")
            if texts.created is not None:
                created.append(f"{texts.created}{_number(child._created)}\n")
        if created:
            out.append(self._created_head)
            out.extend(created)

    def _series(self, labelvalues: tuple[str, ...], child: Any) -> _SeriesText:
        """The child's texts, from the samples prometheus_client itself would collect."""
        named = list(zip(self._metric._labelnames, labelvalues, strict=True))
        samples: list[str] = []
        created = None
        for s in child._child_samples():
            text = f"{_metric_name(self._name + s.name)}{_labels(named + list(s.labels.items()))} "
            if s.name == "_created":
                created = text
            else:
                samples.append(text)
        texts = _SeriesText(tuple(samples), created)
        if len(self._texts) < self._max:
            self._texts[labelvalues] = texts
        return texts


class _CollectedPage:
    """The lines of any other collector: ``collect()`` at every scrape."""

    def __init__(self, collector: Collector) -> None:
        self._collector = collector

    def render(self, out: list[str]) -> None:
        for metric in self._collector.collect():
            _family(out, metric)


class Registry(CollectorRegistry):
    """A registry that renders its own page (:meth:`exposition`), in the order its collectors
    were registered, as ``generate_latest`` would (which still works on it)."""

    def __init__(self, max_series: int = MAX_SERIES) -> None:
        self._max_series = max_series
        self._pages: dict[Collector, _WrapperPage | _CollectedPage] = {}
        super().__init__()

    def register(self, collector: Collector) -> None:
        super().register(collector)
        if isinstance(collector, Counter | Histogram):
            self._pages[collector] = _WrapperPage(collector, self._max_series)
        else:
            self._pages[collector] = _CollectedPage(collector)

    def unregister(self, collector: Collector) -> None:
        super().unregister(collector)
        del self._pages[collector]

    def set_target_info(self, labels: dict[str, str] | None) -> None:
        if labels:
            raise NotImplementedError("the proxy's page has no target_info")
        super().set_target_info(labels)

    def exposition(self) -> bytes:
        out: list[str] = []
        for page in self._pages.values():
            page.render(out)
        return "".join(out).encode()
