"""The FIFO capacity of a scenario's traffic on ``accel_sim``: where load starts to queue.

``accel_sim`` sleeps ``base_ms + per_token_us x rows_in_batch x longest_row`` per batch. A FIFO
batcher (what Triton does without priorities, under load) takes requests in arrival order
until the next one would pass ``max_batch_size`` rows, so every batch mixes the classes in
proportion to their rates and is padded to its longest request. Over a long run each server
completes ``E[requests per batch]`` requests every ``E[batch time]`` (renewal-reward), so

    FIFO capacity = servers x E[requests per batch] / E[batch time]

estimated here by Monte Carlo over the scenario's mix (each class weighted by its mean rate,
bursts included). Offered load above it queues without bound for a FIFO batcher; a scheduler
that keeps short requests out of long batches can serve more. The scenario files quote these
figures; ``triton-proxy bench`` prints them before a run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType

import numpy as np
from numpy.typing import NDArray

from proxy.bench.scenario import Scenario, _draw_sizes

ACCEL_SIM_DEFAULTS = {"base_ms": 3.0, "per_token_us": 2.0}
"""``model_repository/accel_sim/config.pbtxt``'s own parameters."""
ACCEL_SIM_MAX_BATCH = 16


@dataclass(frozen=True)
class Capacity:
    requests_per_s: float
    """FIFO capacity of the whole fleet, requests per second."""
    batch_requests: float
    """Mean requests per FIFO batch."""
    batch_rows: float
    batch_ms: float
    """Mean FIFO batch time."""
    padded_tokens: float
    """Mean longest row of a FIFO batch (what every row is padded to)."""
    offered_rps: float
    """The scenario's offered load (mean rates, bursts included) at factor 1."""
    sorted_requests_per_s: float
    """The same requests batched after sorting by length (every batch holds requests of
    similar length): about the most any order can get out of the fleet, the headroom that
    scheduling can win over FIFO."""

    @property
    def rho(self) -> float:
        """Offered load / FIFO capacity at factor 1."""
        return self.offered_rps / self.requests_per_s

    def scale_for(self, rho: float) -> float:
        """The load factor (``--scale``) at which the offered load is ``rho`` x capacity."""
        return rho / self.rho

    def render(self, servers: int) -> str:
        return (
            f"FIFO capacity {self.requests_per_s:.0f} req/s on {servers} servers "
            f"(batches of {self.batch_requests:.1f} requests / {self.batch_rows:.1f} rows padded "
            f"to {self.padded_tokens:.0f} tokens, {self.batch_ms:.1f} ms); offered at x1 "
            f"{self.offered_rps:.0f} req/s = {self.rho:.2f} x capacity; batched by length "
            f"{self.sorted_requests_per_s:.0f} req/s"
        )


def fifo_capacity(
    scenario: Scenario,
    *,
    servers: int = 3,
    max_batch_size: int = ACCEL_SIM_MAX_BATCH,
    base_ms: float | None = None,
    per_token_us: float | None = None,
    requests: int = 200_000,
    rng: np.random.Generator | None = None,
) -> Capacity:
    """Monte Carlo FIFO capacity (see the module doc); device parameters default to the
    scenario's ``model.parameters``, then ``accel_sim``'s file defaults."""
    params = {**ACCEL_SIM_DEFAULTS, **dict(scenario.model.parameters)}
    base = float(params["base_ms"]) if base_ms is None else base_ms
    per_token = float(params["per_token_us"]) if per_token_us is None else per_token_us
    gen = rng if rng is not None else np.random.default_rng(0)
    names = scenario.class_names
    rates = np.array([scenario.classes[n].mean_rate_rps(scenario.duration_s) for n in names])
    if not rates.sum() > 0:
        raise ValueError("the scenario offers no load")
    which = gen.choice(len(names), size=requests, p=rates / rates.sum())
    tokens = np.empty(requests, dtype=np.int64)
    rows = np.empty(requests, dtype=np.int64)
    for k, name in enumerate(names):
        sel = which == k
        tokens[sel], rows[sel], _ = _draw_sizes(scenario.classes[name].sizes, int(sel.sum()), gen)
    if rows.max() > max_batch_size:
        raise ValueError(
            f"a request of {rows.max()} rows does not fit max_batch_size {max_batch_size}"
        )
    batches = fifo_batches(rows, tokens, max_batch_size)
    n_batches = len(batches)
    batch_rows = np.array([r for r, _ in batches], dtype=float)
    longest = np.array([t for _, t in batches], dtype=float)
    times_s = base / 1e3 + per_token / 1e6 * batch_rows * longest
    order = np.argsort(tokens, kind="stable")
    by_length = fifo_batches(rows[order], tokens[order], max_batch_size)
    sorted_s = sum(base / 1e3 + per_token / 1e6 * r * t for r, t in by_length)
    return Capacity(
        sorted_requests_per_s=servers * requests / sorted_s,
        requests_per_s=servers * requests / float(times_s.sum()),
        batch_requests=requests / n_batches,
        batch_rows=float(batch_rows.mean()),
        batch_ms=float(times_s.mean() * 1e3),
        padded_tokens=float(longest.mean()),
        offered_rps=scenario.offered_rps,
    )


def class_capacity(scenario: Scenario, name: str, *, servers: int = 3) -> float:
    """Requests per second the fleet completes of class ``name`` alone: :func:`fifo_capacity`
    of a scenario holding only that class (its batches hold its requests only)."""
    only = replace(scenario, classes=MappingProxyType({name: scenario.classes[name]}))
    return fifo_capacity(only, servers=servers, requests=20_000).requests_per_s


def fifo_batches(
    rows: NDArray[np.int64], tokens: NDArray[np.int64], max_batch_size: int
) -> list[tuple[int, int]]:
    """``(rows, longest tokens)`` of each batch formed in order, closed when the next request
    would pass ``max_batch_size`` rows."""
    out: list[tuple[int, int]] = []
    filled = longest = 0
    for r, t in zip(rows.tolist(), tokens.tolist(), strict=True):
        if filled and filled + r > max_batch_size:
            out.append((filled, longest))
            filled = longest = 0
        filled += r
        longest = max(longest, t)
    if filled:
        out.append((filled, longest))
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m proxy.bench.capacity SCENARIO.yaml [...]``: print each one's FIFO capacity,
    and what each class with a ``min_share`` is guaranteed."""
    import argparse

    from proxy.bench.scenario import load_scenario

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("scenario", nargs="+")
    parser.add_argument("--servers", type=int, default=3)
    args = parser.parse_args(argv)
    for path in args.scenario:
        sc = load_scenario(path)
        cap = fifo_capacity(sc, servers=args.servers)
        print(f"{path}: {cap.render(args.servers)}")
        for name, spec in sc.classes.items():
            if spec.min_share:
                alone = class_capacity(sc, name, servers=args.servers)
                print(
                    f"  {name}: {alone:.0f} req/s alone; min_share {spec.min_share:g} = "
                    f"{spec.min_share * alone:.1f} req/s"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
