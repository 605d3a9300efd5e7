"""Faults against real Triton servers under real tritonclient traffic (issue 9, point 9).

- SIGKILL one of 3 under load: every request sent after the kill succeeds (a refused
  connection or a pooled connection to the dead process is retried elsewhere); the few that
  were on the victim when it died fail with a Triton-style error; the victim is ejected.
- SIGSTOP one under load: its requests end with a timeout answer after
  ``limits.request_timeout_s`` (not the client's own, much longer timeout), requests placed
  after its ejection are unaffected, and after SIGCONT it rejoins and serves again.

Reload and shutdown under load are in ``test_lifecycle.py`` (same fleet, same clients).
Every test restores the shared session fleet (restart after SIGKILL, SIGCONT after SIGSTOP)
even when it fails.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.integration.harness import ProxyThread, running_proxy

pytestmark = pytest.mark.integration

VICTIM = 1
CLIENT_TIMEOUT_S = 30.0


@dataclass
class Outcome:
    protocol: str
    started: float
    ended: float
    ok: bool
    status: str = ""
    error: str = ""


def _inputs(module: Any) -> list[Any]:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    out = []
    for name in ("INPUT0", "INPUT1"):
        i = module.InferInput(name, [1, 16], "INT32")
        i.set_data_from_numpy(a)
        out.append(i)
    return out


@contextmanager
def load(
    proxy: ProxyThread, outcomes: list[Outcome], http: int = 3, grpc: int = 2
) -> Iterator[None]:
    """Closed-loop tritonclient HTTP and gRPC clients on ``simple`` until the block exits."""
    stop = threading.Event()

    def record(protocol: str, started: float, exc: Exception | None) -> None:
        # A transport error (not an InferenceServerException) is recorded with no status:
        # it fails the "Triton-style error" assertion instead of ending the client loop.
        triton = isinstance(exc, InferenceServerException)
        outcomes.append(
            Outcome(
                protocol,
                started,
                time.monotonic(),
                exc is None,
                str(exc.status()) if triton else "",  # type: ignore[union-attr]
                str(exc.message()) if triton else repr(exc) if exc is not None else "",  # type: ignore[union-attr]
            )
        )

    def http_loop() -> None:
        with httpclient.InferenceServerClient(
            proxy.http, network_timeout=CLIENT_TIMEOUT_S, connection_timeout=CLIENT_TIMEOUT_S
        ) as c:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    c.infer("simple", _inputs(httpclient))
                    record("http", started, None)
                except Exception as exc:  # every failure is recorded and asserted on
                    record("http", started, exc)

    def grpc_loop() -> None:
        with grpcclient.InferenceServerClient(proxy.grpc) as c:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    c.infer("simple", _inputs(grpcclient), client_timeout=CLIENT_TIMEOUT_S)
                    record("grpc", started, None)
                except Exception as exc:  # every failure is recorded and asserted on
                    record("grpc", started, exc)

    loops: list[Callable[[], None]] = [http_loop] * http + [grpc_loop] * grpc
    with ThreadPoolExecutor(len(loops)) as pool:
        futures = [pool.submit(f) for f in loops]
        try:
            yield
        finally:
            stop.set()
            for f in futures:
                f.result(timeout=CLIENT_TIMEOUT_S + 10)


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.02)
    return time.monotonic()


def triton_style(o: Outcome) -> bool:
    """An error a Triton client understands: an HTTP status with a message (the client
    parsed a {"error": ...} body) or a gRPC status with details; not a transport failure."""
    if o.protocol == "http":
        return o.status.isdigit() and int(o.status) >= 400 and bool(o.error)
    return o.status.startswith("StatusCode.") and bool(o.error)


def decisions_for(proxy: ProxyThread, name: str) -> int:
    """Requests placed on instance ``name``: the router's choices, and the requests sent there
    instead to wake a quiet instance (routing.wake: a stopped instance looks quiet, and draws
    one such request before it is ejected)."""
    stats = proxy.runtime.router.stats.decisions
    chosen = sum(
        n for (model, _, inst), n in list(stats.items()) if inst == name and model == "simple"
    )
    woken = proxy.runtime.telemetry.registry.get_sample_value(
        "triton_proxy_quiet_wakes_total", {"instance": name}
    )
    return chosen + int(woken or 0)


def _stub_down(http_url: str) -> str | None:
    """Triton's error when its ``simple`` model's Python stub is dead, else None."""
    with httpclient.InferenceServerClient(http_url.removeprefix("http://")) as c:
        try:
            c.infer("simple", _inputs(httpclient))
        except InferenceServerException as exc:
            return str(exc) if "is not healthy" in str(exc) else None
    return None


def ok_answers(proxy: ProxyThread, name: str) -> float:
    """Requests the instance answered 200 (HTTP) or OK (gRPC), from the proxy's counter."""
    return sum(
        s.value
        for metric in proxy.proxy.telemetry.requests.collect()
        for s in metric.samples
        if s.name.endswith("_total")
        and s.labels["instance"] == name
        and s.labels["outcome"] in ("200", "ok")
    )


def test_sigkill_one_of_three_under_load(triton_fleet: Any) -> None:
    name = triton_fleet.server(VICTIM).name
    doc = {"health": {"interval_s": 0.2, "backoff_initial_s": 0.2, "backoff_max_s": 1.0}}
    outcomes: list[Outcome] = []
    try:
        with running_proxy(triton_fleet.servers, doc) as proxy, load(proxy, outcomes):
            fleet = proxy.runtime.fleet
            wait_for(lambda: len(outcomes) >= 60, 60, "warm-up traffic")
            wait_for(lambda: decisions_for(proxy, name) >= 5, 30, "traffic on the victim")
            on_victim = fleet.get(name).in_flight
            triton_fleet.kill(VICTIM)  # SIGKILL to its process group, reaped
            killed_at = time.monotonic()
            wait_for(lambda: not fleet.get(name).healthy, 10, "victim ejected")
            n = len(outcomes)
            wait_for(lambda: len(outcomes) >= n + 150, 60, "traffic after the kill")
    finally:
        triton_fleet.restart(VICTIM)

    after = [o for o in outcomes if o.started > killed_at]
    late_failures = [o for o in after if not o.ok]
    assert not late_failures, (
        f"{len(late_failures)} of {len(after)} requests sent after the kill failed "
        f"(nothing had reached the dead instance): {late_failures[:3]}"
    )
    early_failures = [o for o in outcomes if o.started <= killed_at and not o.ok]
    # In flight on the victim when it died, plus the odd one placed there between the count
    # and the signal.
    assert len(early_failures) <= on_victim + 2, (on_victim, early_failures)
    not_triton = [o for o in early_failures if not triton_style(o)]
    assert not not_triton, f"failures without a Triton-style error: {not_triton}"


def _signal_group(pid: int, sig: signal.Signals) -> None:
    # The server process only, not its Python backend stubs (its process group): stopped
    # together, the stubs sometimes did not survive the resume (dead stub answering 500 for
    # ever, or the server aborting on a boost::interprocess lock_exception; CI, session 8),
    # which broke the server for the tests after this one. A stalled server is the fault
    # under test; its stubs stalled with it only tested Triton's python backend.
    os.kill(pid, sig)


def test_sigstop_one_of_three_under_load(triton_fleet: Any) -> None:
    victim = triton_fleet.server(VICTIM)
    timeout_s = 2.0
    doc = {
        "routing": {"policy": {"name": "round_robin"}},
        "limits": {"request_timeout_s": timeout_s},
        "health": {
            "interval_s": 0.2,
            "timeout_s": 0.5,
            "backoff_initial_s": 0.2,
            "backoff_max_s": 1.0,
        },
    }
    outcomes: list[Outcome] = []
    stopped = False
    try:
        with running_proxy(triton_fleet.servers, doc) as proxy:
            fleet = proxy.runtime.fleet
            with load(proxy, outcomes):
                wait_for(lambda: len(outcomes) >= 60, 60, "warm-up traffic")
                _signal_group(victim.pid, signal.SIGSTOP)
                stopped = True
                stopped_at = time.monotonic()
                placed_before = decisions_for(proxy, victim.name)
                on_victim = fleet.get(victim.name).in_flight
                ejected_at = wait_for(
                    lambda: not fleet.get(victim.name).healthy, 30, "stopped instance ejected"
                )
                placed_there = decisions_for(proxy, victim.name) - placed_before + on_victim
                n = len(outcomes)
                wait_for(lambda: len(outcomes) >= n + 100, 60, "traffic after the ejection")
            _signal_group(victim.pid, signal.SIGCONT)
            stopped = False
            wait_for(lambda: fleet.get(victim.name).healthy, 60, "instance rejoined after SIGCONT")
            # Serving again: requests it answers (200) through the proxy. A resumed server may
            # still be working off its backlog, so its first requests may time out (504).
            before = ok_answers(proxy, victim.name)
            placed_before_resume = decisions_for(proxy, victim.name)
            resumed: list[str] = []
            with httpclient.InferenceServerClient(proxy.http, network_timeout=30) as c:
                deadline = time.monotonic() + 30
                while ok_answers(proxy, victim.name) - before < 5 and time.monotonic() < deadline:
                    try:
                        c.infer("simple", _inputs(httpclient))
                    except InferenceServerException as exc:
                        resumed.append(str(exc))
            served_after = ok_answers(proxy, victim.name) - before
            placed_after = decisions_for(proxy, victim.name) - placed_before_resume
            victim_state = fleet.get(victim.name)
            stub_down = _stub_down(victim.http_url)
    finally:
        if stopped:
            _signal_group(victim.pid, signal.SIGCONT)
    if stub_down:
        # Triton's own Python backend stub did not survive SIGSTOP (it was stopped with its
        # server): the server stays ready but answers 500 to every request. Later tests get
        # a fresh one.
        triton_fleet.restart(VICTIM)

    failures = [o for o in outcomes if not o.ok]
    assert failures, "no request reached the stopped instance (the test did not bite)"
    late = [o for o in failures if o.started > ejected_at]
    assert not late, f"requests placed after the ejection failed: {late[:3]}"
    assert len(failures) <= placed_there, (
        f"{len(failures)} failures, but only {placed_there} requests were placed on the victim"
    )
    not_timeouts = [
        o
        for o in failures
        if not triton_style(o) or o.status not in ("504", "StatusCode.DEADLINE_EXCEEDED")
    ]
    assert not not_timeouts, f"failures other than the configured timeout: {not_timeouts[:3]}"
    # "As configured": ended by the proxy's request_timeout_s, not the client's 30 s. The
    # margin is generous (a loaded machine); the client's timeout is far beyond it.
    slow = [o for o in failures if o.ended - o.started > timeout_s + 8]
    assert not slow, f"timed out later than request_timeout_s={timeout_s}: {slow[:3]}"
    assert not [o for o in outcomes if o.started < stopped_at and not o.ok and o.ended < stopped_at]
    if stub_down:
        # The proxy routes around it: Triton's "stub is not healthy" answer takes the model
        # out of rotation there and the request is retried elsewhere; no client sees it.
        assert not [e for e in resumed if "is not healthy" in e], resumed[:3]
        assert served_after == 0
        return
    # Diagnostics for a failure seen in CI (sessions 7, 8): were requests placed there at all?
    assert served_after >= 5, (
        f"the resumed instance served {served_after} requests in 30 s; {placed_after} were "
        f"placed there; its state: healthy={victim_state.healthy} "
        f"in_flight={victim_state.in_flight}; errors: {resumed[:3]}"
    )
    print(f"after SIGCONT: {len(resumed)} errors before it served again: {resumed[:2]}")


def _ids(n: int) -> list[httpclient.InferInput]:
    i = httpclient.InferInput("INPUT_IDS", [1, n], "INT64")
    ids = (np.arange(n, dtype=np.int64) % 999 + 1).reshape(1, n)  # accel_sim's VOCAB is 1000
    i.set_data_from_numpy(ids, binary_data=True)
    return [i]


def test_sigterm_under_load_drains_in_flight_and_answers_queued(
    triton_fleet: Any, tmp_path: Any
) -> None:
    """The real CLI, 24 clients over a capacity of 3 (requests queue about 1 s in the proxy),
    then SIGTERM. Every request sent before the signal finishes (200) or gets 503 in Triton's
    format; the requests in flight at the signal finish; the process exits 0. A request sent
    after the signal may find the listener closed (connection refused): that is the point."""
    from tests.fakes.process import ProxyProcess

    policy = {
        "instances": [
            {"name": s.name, "http": s.http_url, "grpc": s.grpc_address}
            for s in triton_fleet.servers
        ],
        "limits": {"drain_timeout_s": 3},
        "scheduling": {
            "default_class": "online",
            "concurrency": 1,
            "classes": {"online": {"rank": 0, "triton_priority": 1, "queue_timeout_s": 60}},
        },
    }
    outcomes: list[Outcome] = []
    stop = threading.Event()
    with ProxyProcess(policy, tmp_path) as proxy:
        url = f"127.0.0.1:{proxy.http_port}"

        def client() -> None:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    # A new connection per request: no keep-alive race at the close.
                    with httpclient.InferenceServerClient(url, network_timeout=60) as c:
                        c.infer("accel_sim", _ids(65536))  # ~135 ms each (3 ms + 2 us/token)
                    outcomes.append(Outcome("http", started, time.monotonic(), True))
                except InferenceServerException as exc:
                    outcomes.append(
                        Outcome(
                            "http",
                            started,
                            time.monotonic(),
                            False,
                            str(exc.status()),
                            str(exc.message()),
                        )
                    )
                except Exception as exc:  # connection refused/closed: recorded, judged below
                    outcomes.append(
                        Outcome("http", started, time.monotonic(), False, "", repr(exc))
                    )
                    time.sleep(0.05)

        with ThreadPoolExecutor(24) as pool:
            futures = [pool.submit(client) for _ in range(24)]
            try:
                try:
                    wait_for(
                        lambda: sum(o.ok for o in outcomes) >= 30, 90, "traffic before SIGTERM"
                    )
                except AssertionError as exc:
                    raise AssertionError(f"{exc}; outcomes: {outcomes[:3]}") from None
                proxy.signal(signal.SIGTERM)
                signalled = time.monotonic()
                code = proxy.wait(30)
            finally:
                stop.set()
                for f in futures:
                    f.result(timeout=90)
        log = proxy.log()
    # Sent at least 0.5 s before the signal: accepted by the proxy by then (a connection still
    # in the listen backlog when the listener closes is reset by the kernel, whatever the
    # proxy does), and many still queued in it.
    before = [o for o in outcomes if o.started < signalled - 0.5]
    bad = [o for o in before if not o.ok and not (o.status == "503" and o.error)]
    assert code == 0, f"exit status {code}:\n{log[-2000:]}"
    assert not bad, f"requests sent before SIGTERM that neither finished nor got 503: {bad[:5]}"
    finished_after_signal = [o for o in before if o.ok and o.ended > signalled]
    assert finished_after_signal, "no request in flight at SIGTERM finished (drain did not bite)"
    print(
        f"sent >= 0.5 s before SIGTERM: {len(before)}, finished after it: "
        f"{len(finished_after_signal)}, 503: {sum(o.status == '503' for o in before)}"
    )
