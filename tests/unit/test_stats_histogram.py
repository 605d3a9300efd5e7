"""The HDR-style histogram against exact order statistics."""

from __future__ import annotations

import math

import numpy as np
import pytest

from proxy.stats.histogram import Histogram


def exact(values: np.ndarray, q: float) -> int:
    s = np.sort(values)
    return int(s[max(1, math.ceil(q * s.size)) - 1])


DISTRIBUTIONS = {
    "lognormal_us": lambda rng: rng.lognormal(9, 1.5, 50_000),
    "uniform_small": lambda rng: rng.uniform(0, 3000, 20_000),
    "bimodal": lambda rng: np.concatenate(
        [rng.normal(2_000, 100, 9_000), rng.normal(4_000_000, 50_000, 1_000)]
    ),
    "heavy_tail": lambda rng: rng.pareto(1.2, 30_000) * 1000 + 1,
}


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_quantiles_match_exact_within_precision(dist):
    rng = np.random.default_rng(5)
    values = np.abs(DISTRIBUTIONS[dist](rng)).astype(np.int64)
    h = Histogram(3)
    h.record_many(values)
    assert h.count == values.size
    for q in (0.0, 0.5, 0.9, 0.95, 0.99, 0.999, 0.9999, 1.0):
        want = exact(values, q)
        got = h.quantile(q)
        assert got is not None
        # reports the bucket's highest equivalent value: never below, at most 0.1% above
        assert want <= got <= want + max(1, want * 1e-3), (q, got, want)
        # and agrees with numpy's order statistics around that rank
        lo = np.percentile(values, 100 * q, method="lower")
        hi = np.percentile(values, 100 * q, method="higher")
        assert lo <= got <= hi + max(1, hi * 1e-3)


def test_small_values_are_exact():
    h = Histogram(3)
    h.record_many(range(1000))
    assert h.quantile(0.5) == 499
    assert h.min == 0 and h.max == 999
    assert h.mean == pytest.approx(499.5)


def test_record_and_record_many_agree_and_merge_is_union():
    rng = np.random.default_rng(1)
    a_vals = rng.lognormal(8, 2, 5000).astype(np.int64)
    b_vals = rng.lognormal(12, 1, 3000).astype(np.int64)
    a1, a2 = Histogram(), Histogram()
    for v in a_vals:
        a1.record(int(v))
    a2.record_many(a_vals)
    assert a1.to_dict() == a2.to_dict()
    b = Histogram()
    b.record_many(b_vals)
    both = Histogram()
    both.record_many(np.concatenate([a_vals, b_vals]))
    a1.merge(b)
    assert a1.to_dict() == both.to_dict()
    for q in (0.5, 0.99, 0.999):
        assert a1.quantile(q) == both.quantile(q)


def test_bucket_edges_are_consistent():
    h = Histogram(3)
    for i in range(0, 40_000, 7):
        lo, hi = h.lowest_equivalent(i), h.highest_equivalent(i)
        assert h.index_of(lo) == i and h.index_of(hi) == i and h.index_of(hi + 1) == i + 1
        assert (hi - lo + 1) / max(lo, 1) <= 1e-3 or hi == lo


def test_serialisation_round_trip():
    h = Histogram(2)
    h.record_many([1, 5, 5, 900, 10**7])
    back = Histogram.from_dict(h.to_dict())
    assert back.to_dict() == h.to_dict()
    assert back.quantile(0.5) == h.quantile(0.5)
    assert back.count == 5


def test_empty_and_invalid():
    h = Histogram()
    assert h.quantile(0.99) is None and h.count == 0 and h.mean is None
    with pytest.raises(ValueError):
        h.record(-1)
    with pytest.raises(ValueError):
        h.quantile(1.5)
    with pytest.raises(ValueError):
        h.merge(Histogram(2))
