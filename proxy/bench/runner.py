"""The open-loop runner: sends a fixed schedule to a target and times each request.

Each arrival is fired at its scheduled time as its own task; the runner never waits for an
earlier request before sending a later one. A request's latency is its completion time minus
its *scheduled* send time, so any delay before the request really leaves (a busy event loop, a
full connection pool, a stalled server holding the only connection) is charged to the request
instead of silently thinning the load: no coordinated omission.

Targets plug in through :class:`Target`. :class:`HttpTarget` covers the arms that speak KServe
v2 HTTP directly: round robin over Triton servers (with or without each class's Triton
``priority``), or one URL (HAProxy, triton-proxy). What it sends is described by a picklable
:class:`TargetSpec`, so a later multi-process runner can rebuild the target in a worker.
"""

from __future__ import annotations

import asyncio
import enum
import json
import sys
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TextIO
from urllib.parse import urlsplit

import aiohttp
import numpy as np
from numpy.typing import NDArray
from prometheus_client.parser import text_string_to_metric_families

from proxy import collector
from proxy.bench.scenario import Arrival, ClassSpec, ModelSpec, Scenario
from proxy.clock import Clock, MonotonicClock
from proxy.fleet import http1
from proxy.fleet.http1 import Http1Pool

Sleep = Callable[[float], Awaitable[None]]


class Outcome(enum.IntEnum):
    OK = 0
    SHED = 1
    """HTTP 429: the proxy shed the request (Triton itself answers a full queue with 503)."""
    ERROR = 2


PENDING = -1
"""Outcome code of a request that has not completed (still in flight, or never sent)."""


@dataclass(frozen=True, slots=True)
class SendResult:
    outcome: Outcome
    status: int = 0
    """HTTP status, 0 when no response came back (timeout, connection error)."""
    instance: str | None = None
    """Which server answered, when the client can tell."""
    error: str | None = None
    batch: tuple[int, int, int] | None = None
    """The batch the request ran in, when the model reports it (:func:`batch_seen`)."""
    origin: tuple[int, int] | None = None
    """When and where that batch ran, when the model reports it (:func:`batch_origin`)."""


class Target(Protocol):
    name: str

    async def send(self, arrival: Arrival) -> SendResult:
        """Send one request and wait for its whole response."""
        ...

    async def aclose(self) -> None: ...


# -- request encoding ----------------------------------------------------------------------

_NP_TYPES = {"INT64": np.int64, "INT32": np.int32}


class RequestEncoder:
    """Builds KServe v2 infer bodies and headers; cached per (tokens, rows, priority).

    The input's shape is ``[rows, tokens]``: ``rows`` rows of the batch dimension.
    """

    def __init__(self, model: ModelSpec, classes: Mapping[str, ClassSpec], priority: bool) -> None:
        self.model = model
        self.classes = classes
        self.priority = priority
        version = f"/versions/{model.version}" if model.version else ""
        self.path = f"/v2/models/{model.name}{version}/infer"
        self._bodies: dict[tuple[int, int, int], tuple[bytes, dict[str, str]]] = {}

    def _body(self, tokens: int, priority: int, rows: int = 1) -> tuple[bytes, dict[str, str]]:
        key = (tokens, rows, priority)
        cached = self._bodies.get(key)
        if cached is not None:
            return cached
        m = self.model
        names = (m.input, *m.extra_inputs)
        tensors: list[dict[str, object]] = [
            {"name": name, "shape": [rows, tokens], "datatype": m.datatype} for name in names
        ]
        params: dict[str, object] = {}
        if priority:
            params["priority"] = priority
        if m.encoding == "binary":
            data = np.ones(rows * tokens, dtype=_NP_TYPES[m.datatype]).tobytes()
            for tensor in tensors:
                tensor["parameters"] = {"binary_data_size": len(data)}
            params["binary_data_output"] = True
            header = json.dumps({"inputs": tensors, "parameters": params}).encode()
            built = (
                header + data * len(tensors),
                {
                    "Content-Type": "application/octet-stream",
                    "Inference-Header-Content-Length": str(len(header)),
                },
            )
        else:
            for tensor in tensors:
                tensor["data"] = [1] * (rows * tokens)
            doc: dict[str, object] = {"inputs": tensors}
            if params:
                doc["parameters"] = params
            built = (json.dumps(doc).encode(), {"Content-Type": "application/json"})
        self._bodies[key] = built
        return built

    def encode(self, arrival: Arrival) -> tuple[bytes, dict[str, str]]:
        spec = self.classes[arrival.cls]
        body, base = self._body(
            arrival.tokens, spec.triton_priority if self.priority else 0, arrival.rows
        )
        headers = dict(base)
        if spec.api_key:
            headers["Authorization"] = f"Bearer {spec.api_key}"
        if arrival.session is not None:
            headers["x-session-id"] = arrival.session
        return body, headers


BATCH_OUTPUTS = ("BATCH_SIZE", "PADDED_LENGTH", "BATCH_COST_US")
"""Outputs of ``accel_sim`` that say which batch a request ran in: its rows, the length every
row was padded to, and the emulated device time it took (microseconds)."""

BATCH_ORIGIN = ("BATCH_START_US", "BATCH_SERVER")
"""Outputs of ``accel_sim`` that say when that batch began (microseconds of the host's
monotonic clock, the load generator's own clock) and which server ran it (its process id)."""


def int_outputs(
    headers: Sequence[tuple[str, str]], body: bytes, names: Sequence[str]
) -> dict[str, int]:
    """The first value of each INT64 output among ``names`` that a successful answer carries
    (binary or JSON outputs). Only the small JSON header is parsed; the tensors are not
    copied."""
    length = next((v for k, v in headers if k.lower() == "inference-header-content-length"), None)
    try:
        header_len = int(length) if length is not None else len(body)
        doc = json.loads(body[:header_len])
    except ValueError:
        return {}
    if not isinstance(doc, dict):
        return {}
    found: dict[str, int] = {}
    offset = header_len
    for out in doc.get("outputs") or ():
        size = (out.get("parameters") or {}).get("binary_data_size")
        name = out.get("name")
        if size is not None:
            if name in names and out.get("datatype") == "INT64" and size >= 8:
                found[name] = int.from_bytes(body[offset : offset + 8], "little", signed=True)
            offset += int(size)
        elif name in names and out.get("data"):
            found[name] = int(out["data"][0])
    return found


def batch_seen(found: Mapping[str, int]) -> tuple[int, int, int] | None:
    """``(rows, padded length, cost in us)`` of the batch an answer ran in, from its
    :func:`int_outputs`, or None when the model does not report all of :data:`BATCH_OUTPUTS`."""
    if any(k not in found for k in BATCH_OUTPUTS):
        return None
    rows, padded, cost = (found[k] for k in BATCH_OUTPUTS)
    return rows, padded, cost


def batch_origin(found: Mapping[str, int]) -> tuple[int, int] | None:
    """``(start in us, server pid)`` of that batch (:data:`BATCH_ORIGIN`), or None."""
    if any(k not in found for k in BATCH_ORIGIN):
        return None
    start, server = (found[k] for k in BATCH_ORIGIN)
    return start, server


# -- HTTP targets --------------------------------------------------------------------------


@dataclass(frozen=True)
class TargetSpec:
    """How an arm sends requests; plain data, so it can cross a process boundary.

    One URL: every request goes there and the serving instance is read from the
    ``instance_header`` response header when present. Several URLs: client-side round robin,
    the way a Kubernetes Service spreads connections, and the instance is known.
    """

    urls: tuple[str, ...]
    priority: bool = False
    """Set each class's ``triton_priority`` as the request's ``parameters.priority``."""
    instance_names: tuple[str, ...] | None = None
    instance_header: str | None = "x-served-by"
    connection_limit: int = 1000
    """Open connections per URL and class at most; requests beyond wait, and that wait
    counts."""

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("a target needs at least one URL")
        if self.instance_names is not None and len(self.instance_names) != len(self.urls):
            raise ValueError("instance_names must match urls one to one")


def instance_name(url: str) -> str:
    parts = urlsplit(url)
    return parts.netloc or url


class HttpTarget:
    """KServe v2 HTTP client for one arm (see :class:`TargetSpec`).

    It sends through the proxy's own HTTP/1.1 client (:class:`~proxy.fleet.http1.Http1Pool`,
    kept-alive connections), not aiohttp's: the generator shares the machine with the arm and
    the servers, and every millisecond of CPU it spends per request is taken from them or
    delays its own schedule. aiohttp's client cost the proxy about twice as much CPU per
    request (docs/benchmarks.md, "What was cut").

    Each class has its own connections to each URL, as separate clients (a chat service, an
    evaluation job) would: a class whose requests pile up in a queue opens connections for
    them, and a request of another class does not wait for one of those to be set up. With
    one shared pool, at issue 10's x2 load the offline backlog kept the pool growing, and the
    real-time requests that drew a new connection waited 137 ms (median) before the proxy
    accepted it (2 December, docs/benchmarks.md)."""

    def __init__(self, name: str, spec: TargetSpec, scenario: Scenario) -> None:
        self.name = name
        self.spec = spec
        self.encoder = RequestEncoder(scenario.model, scenario.classes, spec.priority)
        self._names = list(spec.instance_names or [instance_name(u) for u in spec.urls])
        self._next = 0
        self._timeout_s = scenario.timeout_s
        self._pools = {
            cls: [
                Http1Pool(u.rstrip("/"), spec.connection_limit, scenario.timeout_s)
                for u in spec.urls
            ]
            for cls in scenario.classes
        }
        self._header = (spec.instance_header or "").lower()

    async def send(self, arrival: Arrival) -> SendResult:
        body, headers = self.encoder.encode(arrival)
        k = self._next
        self._next = (k + 1) % len(self._names)
        known = self._names[k] if len(self._names) > 1 else None
        try:
            async with asyncio.timeout(self._timeout_s):
                resp = await self._pools[arrival.cls][k].request(
                    "POST", self.encoder.path, list(headers.items()), body
                )
        except TimeoutError:
            return SendResult(Outcome.ERROR, 0, known, "client timeout")
        except http1.FAILURES as exc:
            return SendResult(Outcome.ERROR, 0, known, f"{type(exc).__name__}: {exc}"[:120])
        instance = known
        if instance is None and self._header:
            instance = next((v for n, v in resp.headers if n.lower() == self._header), None)
        if resp.status == 200:
            found = int_outputs(resp.headers, resp.body, BATCH_OUTPUTS + BATCH_ORIGIN)
            return SendResult(
                Outcome.OK, 200, instance, batch=batch_seen(found), origin=batch_origin(found)
            )
        if resp.status == 429:  # the whole message: its reason is near the end
            return SendResult(Outcome.SHED, 429, instance, _error_text(resp.body, 400))
        return SendResult(Outcome.ERROR, resp.status, instance, _error_text(resp.body))

    async def aclose(self) -> None:
        for pools in self._pools.values():
            for pool in pools:
                pool.close()


SHED_PHRASES = {
    "slo_p99_ms": "late",
    "queue is full": "queue_full",
    "overloaded": "overload",
    "queue_timeout_s": "timeout",
    "short of CPU": "busy",
}
"""A phrase of the proxy's shed message (``proxy/dispatch.py``) -> the shed reason."""


def shed_reason(error: str | None) -> str:
    """The reason of a 429 from the proxy's message: ``"... was shed: it would be answered
    after its class's slo_p99_ms; retry after 1 s"`` -> ``late``; an unknown wording gives
    its own text up to the ``;``."""
    if not error:
        return "unknown"
    _, sep, why = error.rpartition("shed: ")
    if not sep:
        return "other"
    why = why.split(";", 1)[0].strip()
    for phrase, reason in SHED_PHRASES.items():
        if phrase in why:
            return reason
    return why or "unknown"


def _error_text(payload: bytes, limit: int = 80) -> str:
    try:
        doc = json.loads(payload)
    except ValueError:
        return payload[:limit].decode(errors="replace")
    if isinstance(doc, dict) and isinstance(doc.get("error"), str):
        return str(doc["error"])[:limit]
    return payload[:limit].decode(errors="replace")


# -- per-instance load probes --------------------------------------------------------------


class LoadProbe(Protocol):
    """Samples per-instance load (e.g. queued requests) while a run goes on."""

    async def sample(self) -> Mapping[str, float]: ...

    async def aclose(self) -> None: ...


class PrometheusGaugeProbe:
    """Reads one gauge from Prometheus text endpoints.

    ``urls`` maps a name to a ``/metrics`` URL. Samples of ``metric`` whose labels include
    ``match`` are summed per name, or per value of ``split_label`` when given (one proxy
    endpoint that labels its series by instance). Triton fleet:
    ``PrometheusGaugeProbe({"t0": "http://127.0.0.1:8002/metrics", ...},
    "nv_inference_pending_request_count", {"model": "accel_sim"})``.
    An endpoint that does not answer is left out of that sample.
    """

    def __init__(
        self,
        urls: Mapping[str, str],
        metric: str,
        match: Mapping[str, str] | None = None,
        split_label: str | None = None,
        timeout_s: float = 1.0,
    ) -> None:
        self.urls = dict(urls)
        self.metric = metric
        self.match = dict(match or {})
        self.split_label = split_label
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def fetch(self, url: str) -> str | None:
        """The page at ``url``; None when it does not answer or is not a metrics endpoint
        (yet): no sample, like no answer."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        try:
            async with self._session.get(url) as resp:
                if resp.status != 200:
                    return None
                return await resp.text()
        except (TimeoutError, aiohttp.ClientError, OSError):
            return None

    async def _scrape(self, name: str, url: str) -> dict[str, float]:
        text = await self.fetch(url)
        return {} if text is None else self.read(name, text)

    def read(self, name: str, text: str) -> dict[str, float]:
        """The samples of ``text`` (one scraped page) this probe sums, by key.

        Only the lines of :attr:`metric` are parsed. The probe runs in the load generator's
        event loop, so its CPU delays the requests it sends and the answers it reads: parsing
        all of the proxy's page with classes on (35 KB, about 300 samples) took 5.7 ms, two
        probes read it every 0.5 s, and the proxy arms' requests were charged up to 12 ms of
        the generator's own stall (docs/benchmarks.md, issue 10, seventeenth round)."""
        metric = self.metric
        lines = [
            line
            for line in text.splitlines()
            if line.startswith(metric) and line[len(metric) : len(metric) + 1] in ("{", " ")
        ]
        out: dict[str, float] = {}
        for family in text_string_to_metric_families("\n".join(lines) + "\n"):
            for s in family.samples:
                if s.name != metric:
                    continue
                if any(s.labels.get(k) != v for k, v in self.match.items()):
                    continue
                key = s.labels.get(self.split_label, name) if self.split_label else name
                out[key] = out.get(key, 0.0) + float(s.value)
        return out

    async def sample(self) -> Mapping[str, float]:
        parts = await asyncio.gather(*(self._scrape(n, u) for n, u in self.urls.items()))
        merged: dict[str, float] = {}
        for part in parts:
            merged.update(part)
        return merged

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class OneScrapeProbe:
    """Several :class:`PrometheusGaugeProbe` over the same pages, read from one scrape of each
    page per sample; each probe's names get its suffix. Rendering the proxy's page takes it
    about 5 ms of its event loop with classes on: a benchmark that fetched it once per gauge
    charged the proxy arms that much more than a Prometheus scraping every 15 s would."""

    def __init__(self, parts: Sequence[tuple[PrometheusGaugeProbe, str]]) -> None:
        if not parts or any(p.urls != parts[0][0].urls for p, _ in parts):
            raise ValueError("OneScrapeProbe needs probes over the same pages")
        self.parts = list(parts)

    async def sample(self) -> Mapping[str, float]:
        first = self.parts[0][0]
        names = list(first.urls)
        texts = await asyncio.gather(*(first.fetch(first.urls[n]) for n in names))
        out: dict[str, float] = {}
        for name, text in zip(names, texts, strict=True):
            if text is None:
                continue
            for probe, suffix in self.parts:
                for key, value in probe.read(name, text).items():
                    out[f"{key}{suffix}"] = out.get(f"{key}{suffix}", 0.0) + value
        return out

    async def aclose(self) -> None:
        await self.parts[0][0].aclose()


# -- progress ------------------------------------------------------------------------------


@dataclass
class Counts:
    sent: int = 0
    done: int = 0
    ok: int = 0
    shed: int = 0
    error: int = 0


class Progress(Protocol):
    def update(self, label: str, elapsed: float, horizon: float, counts: Counts) -> None: ...

    def close(self) -> None: ...


class ProgressLine:
    """A one-line progress bar on stderr; plain periodic lines when not on a terminal."""

    def __init__(self, stream: TextIO | None = None, width: int = 24, every_s: float = 5.0):
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.tty = self.stream.isatty()
        self.every_s = every_s
        self._last_plain = -1e9
        self._open = False

    def update(self, label: str, elapsed: float, horizon: float, counts: Counts) -> None:
        elapsed = max(elapsed, 0.0)
        frac = min(elapsed / horizon, 1.0) if horizon > 0 else 1.0
        filled = int(frac * self.width)
        bar = "#" * filled + "-" * (self.width - filled)
        line = (
            f"{label:<22.22} [{bar}] {elapsed:6.1f}/{horizon:.0f}s "
            f"sent {counts.sent} done {counts.done} in-flight {counts.sent - counts.done} "
            f"ok {counts.ok} shed {counts.shed} err {counts.error}"
        )
        if self.tty:
            self.stream.write("\r\x1b[2K" + line)
            self._open = True
        elif elapsed - self._last_plain >= self.every_s or frac >= 1.0:
            self.stream.write(line + "\n")
            self._last_plain = elapsed
        self.stream.flush()

    def close(self) -> None:
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False
        self._last_plain = -1e9


# -- the run -------------------------------------------------------------------------------


@dataclass
class RunRecords:
    """Everything measured in one run, indexed like the schedule. Times are clock seconds."""

    t0: float
    scheduled: NDArray[np.float64]
    started: NDArray[np.float64]
    """When the request's task began sending (scheduled + dispatcher lag)."""
    finished: NDArray[np.float64]
    outcome: NDArray[np.int8]
    status: NDArray[np.int16]
    instance: NDArray[np.int16]
    """Index into ``instances``, -1 when the client could not tell."""
    batch: NDArray[np.int32]
    """Per request ``(rows, padded length, cost in us)`` of the batch it ran in
    (:func:`batch_seen`); -1 where unknown."""
    batch_start: NDArray[np.float64]
    """When that batch began, clock seconds (:func:`batch_origin`; NaN where unknown)."""
    batch_server: NDArray[np.int64]
    """The process id of the server that ran it; -1 where unknown."""
    instances: list[str] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    sheds: Counter[str] = field(default_factory=Counter)
    """``"<class> <reason>"`` -> requests of the measured window shed (429), the reason read
    from the proxy's answer."""
    load_samples: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    """(seconds since t0, instance -> probed load)."""

    @classmethod
    def empty(cls, n: int, t0: float) -> RunRecords:
        nan = np.full(n, np.nan)
        return cls(
            t0=t0,
            scheduled=nan.copy(),
            started=nan.copy(),
            finished=nan.copy(),
            outcome=np.full(n, PENDING, dtype=np.int8),
            status=np.zeros(n, dtype=np.int16),
            instance=np.full(n, -1, dtype=np.int16),
            batch=np.full((n, 3), -1, dtype=np.int32),
            batch_start=nan.copy(),
            batch_server=np.full(n, -1, dtype=np.int64),
        )

    @property
    def latency(self) -> NDArray[np.float64]:
        """Completion minus scheduled send time, seconds (NaN if it never completed)."""
        return self.finished - self.scheduled

    def instance_index(self, name: str) -> int:
        try:
            return self.instances.index(name)
        except ValueError:
            self.instances.append(name)
            return len(self.instances) - 1


async def run_schedule(
    schedule: Sequence[Arrival],
    target: Target,
    *,
    horizon_s: float | None = None,
    clock: Clock | None = None,
    sleep: Sleep = asyncio.sleep,
    start_delay_s: float = 0.05,
    progress: Progress | None = None,
    probe: LoadProbe | None = None,
    probe_interval_s: float = 0.5,
    tick_s: float = 0.25,
) -> RunRecords:
    """Send ``schedule`` open-loop to ``target``; returns when every request has finished.

    ``t0`` (time zero of the schedule) is ``start_delay_s`` after the call, so set-up work
    here does not eat into the first arrivals.
    """
    # The generator measures: its own collector's pauses must not be charged to the arm.
    with collector.quiet_while():
        clk = clock if clock is not None else MonotonicClock()
        horizon = horizon_s if horizon_s is not None else (schedule[-1].t if schedule else 0.0)
        t0 = clk.now() + start_delay_s
        rec = RunRecords.empty(len(schedule), t0)
        counts = Counts()
        tasks: set[asyncio.Task[None]] = set()

        async def fire(i: int, arrival: Arrival) -> None:
            rec.started[i] = clk.now()
            result = await target.send(arrival)
            rec.finished[i] = clk.now()
            rec.outcome[i] = int(result.outcome)
            rec.status[i] = result.status
            if result.instance is not None:
                rec.instance[i] = rec.instance_index(result.instance)
            if result.batch is not None:
                rec.batch[i] = result.batch
            if result.origin is not None:
                rec.batch_start[i] = result.origin[0] / 1e6
                rec.batch_server[i] = result.origin[1]
            counts.done += 1
            if result.outcome == Outcome.OK:
                counts.ok += 1
            elif result.outcome == Outcome.SHED:
                counts.shed += 1
                if not arrival.warmup:  # like every other figure: the measured window only
                    rec.sheds[f"{arrival.cls} {shed_reason(result.error)}"] += 1
            else:
                counts.error += 1
                rec.errors[f"{result.status} {result.error}"] += 1

        async def ticker() -> None:
            # Progress and probes run beside the dispatcher, never in its way.
            next_probe = 0.0
            while True:
                elapsed = clk.now() - t0
                if progress is not None:
                    progress.update(target.name, elapsed, horizon, counts)
                if probe is not None and elapsed >= next_probe:
                    sample = await probe.sample()
                    rec.load_samples.append((clk.now() - t0, dict(sample)))
                    next_probe = elapsed + probe_interval_s
                await sleep(tick_s)

        # Without progress or probe no side task runs, so a fake ``sleep`` only ever sees the
        # dispatcher's own waits.
        side = asyncio.create_task(ticker()) if progress is not None or probe is not None else None
        try:
            for i, arrival in enumerate(schedule):
                due = t0 + arrival.t
                rec.scheduled[i] = due
                delay = due - clk.now()
                if delay > 0:
                    await sleep(delay)
                task = asyncio.create_task(fire(i, arrival))
                counts.sent += 1
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*list(tasks))
            if side is not None and side.done():
                side.result()  # a failed probe is a bug worth seeing, not a silent gap
            if progress is not None:
                progress.update(target.name, clk.now() - t0, horizon, counts)
        finally:
            others = [*tasks, *([side] if side is not None else [])]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)
            if progress is not None:
                progress.close()
        return rec
