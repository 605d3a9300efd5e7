"""Canary rollout against real Triton servers: the split, each arm's policy seen from Triton's
side, and promotion and rollback as policy edits that drop no request."""

from __future__ import annotations

import math
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
import yaml

from proxy.canary import CANARY, MAIN
from proxy.local import TritonServer
from tests.integration.harness import policy_for, running_proxy, settled_successes

pytestmark = pytest.mark.integration

SHARE = 0.3


def write_policy(path: Path, doc: dict[str, Any]) -> None:
    """Replace the policy file in one step, as an operator's deploy tool would: the proxy's
    watcher polls it, and a file truncated then written can be read half-written (a reload
    error, counted; it failed this test's no-error check once in CI)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(doc))
    os.replace(tmp, path)


def inputs() -> list[httpclient.InferInput]:
    out = []
    for name in ("INPUT0", "INPUT1"):
        i = httpclient.InferInput(name, [1, 16], "INT32")
        i.set_data_from_numpy(np.ones((1, 16), dtype=np.int32))
        out.append(i)
    return out


def test_split_holds_and_each_arm_uses_its_own_routing(triton_servers: list[TritonServer]) -> None:
    """Main routes by consistent hash (one session: one instance), the canary round robin
    (spread evenly), so Triton's own per-server counts show which policy placed what."""
    policy = {
        "routing": {"policy": {"name": "consistent_hash"}},
        "canary": {
            "share": SHARE,
            "split": "request",
            "routing": {"policy": {"name": "round_robin"}},
        },
    }
    n = 240
    before = settled_successes(triton_servers, "simple")
    with running_proxy(triton_servers, policy) as proxy:
        with httpclient.InferenceServerClient(proxy.http) as client:
            for _ in range(n):
                client.infer("simple", inputs(), headers={"x-session-id": "user-7"})
        rt = proxy.runtime
        main = Counter(
            {
                i: c
                for (m, p, i), c in rt.router.stats.decisions.items()
                if m == "simple" and p == "consistent_hash"
            }
        )
        canary = Counter(
            {
                i: c
                for (m, p, i), c in rt.canary_router.stats.decisions.items()
                if m == "simple" and p == "round_robin"
            }
        )

        def counted() -> dict[str, float]:
            return {
                arm: sum(
                    s.value
                    for metric in rt.telemetry.requests.collect()
                    for s in metric.samples
                    if s.name.endswith("_total")
                    and s.labels["arm"] == arm
                    and s.labels["model"] == "simple"
                )
                for arm in (MAIN, CANARY)
            }

        # A request is counted just after its answer is written (the dispatcher's deliver).
        wait_for(lambda: sum(counted().values()) >= n)
        by_arm = counted()
    after = settled_successes(triton_servers, "simple")
    received = {name: after[name] - before[name] for name in after}
    n_main, n_canary = sum(main.values()), sum(canary.values())
    assert n_main + n_canary == n == sum(received.values())
    assert by_arm == {MAIN: n_main, CANARY: n_canary}
    # The split: within 4.5 standard deviations of the binomial mean.
    assert abs(n_canary - n * SHARE) <= 4.5 * math.sqrt(n * SHARE * (1 - SHARE)), (n_canary, n)
    # Main: the session's one home instance. Canary: round robin over all three.
    assert len(main) == 1
    home = next(iter(main))
    assert set(canary) == set(received) and max(canary.values()) - min(canary.values()) <= 1
    # Triton's side: the other servers received only the canary's round-robin share, so no
    # main-arm request reached them, and the home server everything else.
    for name, got in received.items():
        assert got == canary[name] + (n_main if name == home else 0), (name, received)


def reloads(proxy: Any, result: str) -> float:
    return proxy.proxy.telemetry.reloads.labels(result)._value.get()  # type: ignore[no-any-return]


def wait_for(predicate: Callable[[], bool], timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


SCHEDULING = {"default_class": "online", "concurrency": 2, "classes": {"online": {"rank": 0}}}


def test_promotion_and_rollback_are_policy_edits_that_drop_nothing(
    triton_servers: list[TritonServer], tmp_path: Path
) -> None:
    path = tmp_path / "policy.yaml"
    doc = policy_for(
        triton_servers,
        {
            "routing": {"policy": {"name": "least_requests"}},
            "scheduling": SCHEDULING,
            "canary": {"share": 0.5, "routing": {"policy": {"name": "round_robin"}}},
        },
    )
    write_policy(path, doc)
    stop = threading.Event()
    done: Counter[str] = Counter()
    errors: list[str] = []

    with running_proxy(triton_servers, doc, policy_path=path, watch_interval_s=0.1) as proxy:

        def client_loop() -> None:
            with httpclient.InferenceServerClient(proxy.http, concurrency=1) as c:
                while not stop.is_set():
                    try:
                        c.infer("simple", inputs())
                        done["ok"] += 1
                    except Exception as exc:  # every failure is recorded and fails the test
                        errors.append(repr(exc))

        threads = [threading.Thread(target=client_loop) for _ in range(4)]
        for t in threads:
            t.start()
        try:
            time.sleep(0.5)
            rt = proxy.runtime
            assert rt.dispatcher.canary is not None

            # Promotion: the canary's routing becomes the main one, the canary section goes.
            doc["routing"] = doc["canary"]["routing"]
            del doc["canary"]
            write_policy(path, doc)
            wait_for(lambda: reloads(proxy, "ok") == 1)
            assert rt.dispatcher.canary is None and rt.router.policy("simple")[0] == "round_robin"
            time.sleep(0.5)

            # A new canary with its own classes, then rolled back.
            doc["canary"] = {"share": 0.5, "scheduling": {**SCHEDULING, "concurrency": 1}}
            write_policy(path, doc)
            wait_for(lambda: reloads(proxy, "ok") == 2)
            assert rt.canary_gates is not None and rt.gates is not None
            assert (rt.gates.share, rt.canary_gates.share) == (0.5, 0.5)
            time.sleep(0.5)
            served_by_canary = sum(rt.canary_router.stats.decisions.values())
            del doc["canary"]
            write_policy(path, doc)
            wait_for(lambda: reloads(proxy, "ok") == 3)
            assert rt.dispatcher.canary is None and rt.gates.share == 1.0
            time.sleep(0.5)
        finally:
            stop.set()
            for t in threads:
                t.join(10)
    assert errors == []
    assert reloads(proxy, "error") == 0
    assert served_by_canary > 0
    assert done["ok"] > 100
