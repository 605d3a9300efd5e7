"""An HDR-style histogram: log-bucketed, fixed relative precision, mergeable.

Layout follows Gil Tene's HdrHistogram with a lowest discernible value of 1: values below
``sub_bucket_count`` (the smallest power of two >= ``2 * 10**digits``) get one bucket each; above
that, every power-of-two range ``[2**m, 2**(m+1))`` is split into ``sub_bucket_count / 2``
equal buckets. A bucket's width is therefore at most ``1 / (sub_bucket_count / 2)`` of its lower
edge, i.e. better than ``10**-digits`` relative error, at any magnitude, with no upper bound set
in advance (the count array grows).

Values are non-negative integers; latencies are recorded in microseconds. Quantiles follow
HdrHistogram's ``getValueAtPercentile``: the smallest bucket whose cumulative count reaches
``ceil(q * total)``, reported as that bucket's highest equivalent value.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
from numpy.typing import NDArray


class Histogram:
    def __init__(self, significant_digits: int = 3) -> None:
        if not 1 <= significant_digits <= 5:
            raise ValueError(f"significant_digits must be 1..5, got {significant_digits}")
        self.significant_digits = significant_digits
        self._sub_count = 1 << math.ceil(math.log2(2 * 10**significant_digits))
        self._half = self._sub_count // 2
        self._half_mag = self._half.bit_length() - 1
        self._counts = np.zeros(self._sub_count, dtype=np.int64)
        self._total = 0
        self._min: int | None = None
        self._max: int | None = None
        self._sum = 0

    # -- indexing -------------------------------------------------------------------------

    def index_of(self, value: int) -> int:
        if value < 0:
            raise ValueError(f"histogram values must be >= 0, got {value}")
        if value < self._sub_count:
            return value
        shift = value.bit_length() - 1 - self._half_mag
        return self._sub_count + (shift - 1) * self._half + ((value >> shift) - self._half)

    def _indices(self, values: NDArray[np.int64]) -> NDArray[np.int64]:
        v = values.astype(np.int64)
        if v.size and int(v.min()) < 0:
            raise ValueError("histogram values must be >= 0")
        # frexp's exponent is the bit length for positive integers below 2**53.
        _, exp = np.frexp(np.maximum(v, 1).astype(np.float64))
        shift = np.maximum(exp.astype(np.int64) - 1 - self._half_mag, 1)
        big = self._sub_count + (shift - 1) * self._half + ((v >> shift) - self._half)
        return np.where(v < self._sub_count, v, big)

    def lowest_equivalent(self, index: int) -> int:
        if index < self._sub_count:
            return index
        shift = (index - self._sub_count) // self._half + 1
        sub = (index - self._sub_count) % self._half + self._half
        return sub << shift

    def highest_equivalent(self, index: int) -> int:
        return self.lowest_equivalent(index + 1) - 1

    # -- recording ------------------------------------------------------------------------

    def _grow(self, index: int) -> None:
        if index >= self._counts.size:
            size = max(index + 1, self._counts.size + self._half)
            self._counts = np.concatenate(
                [self._counts, np.zeros(size - self._counts.size, dtype=np.int64)]
            )

    def record(self, value: int, count: int = 1) -> None:
        i = self.index_of(value)
        self._grow(i)
        self._counts[i] += count
        self._total += count
        self._sum += value * count
        self._min = value if self._min is None else min(self._min, value)
        self._max = value if self._max is None else max(self._max, value)

    def record_many(self, values: Iterable[int] | NDArray[np.int64]) -> None:
        v = np.asarray(values if isinstance(values, np.ndarray) else list(values), np.int64)
        if v.size == 0:
            return
        idx = self._indices(v)
        self._grow(int(idx.max()))
        self._counts += np.bincount(idx, minlength=self._counts.size)
        self._total += int(v.size)
        self._sum += int(v.sum())
        lo, hi = int(v.min()), int(v.max())
        self._min = lo if self._min is None else min(self._min, lo)
        self._max = hi if self._max is None else max(self._max, hi)

    def merge(self, other: Histogram) -> None:
        if other.significant_digits != self.significant_digits:
            raise ValueError("cannot merge histograms of different precision")
        if other._total == 0:
            return
        self._grow(other._counts.size - 1)
        self._counts[: other._counts.size] += other._counts
        self._total += other._total
        self._sum += other._sum
        assert other._min is not None and other._max is not None
        self._min = other._min if self._min is None else min(self._min, other._min)
        self._max = other._max if self._max is None else max(self._max, other._max)

    def copy(self) -> Histogram:
        h = Histogram(self.significant_digits)
        h.merge(self)
        return h

    # -- reading --------------------------------------------------------------------------

    @property
    def count(self) -> int:
        return self._total

    @property
    def min(self) -> int | None:
        return self._min

    @property
    def max(self) -> int | None:
        return self._max

    @property
    def mean(self) -> float | None:
        return self._sum / self._total if self._total else None

    def quantile(self, q: float) -> int | None:
        """Value at quantile ``q`` in [0, 1]; None when empty."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile must be in [0, 1], got {q}")
        if self._total == 0:
            return None
        rank = max(1, math.ceil(q * self._total))
        cum = np.cumsum(self._counts)
        i = int(np.searchsorted(cum, rank, side="left"))
        assert self._max is not None
        return min(self.highest_equivalent(i), self._max)

    def count_at_or_below(self, value: int) -> int:
        """Recorded values whose bucket lies at or below ``value``'s bucket (±precision)."""
        i = self.index_of(value)
        return int(self._counts[: i + 1].sum())

    def cdf(self) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """(bucket upper values, cumulative fraction) over non-empty buckets, for plotting."""
        nz = np.nonzero(self._counts)[0]
        if nz.size == 0:
            return np.zeros(0), np.zeros(0)
        values = np.array([self.highest_equivalent(int(i)) for i in nz], dtype=np.float64)
        frac = np.cumsum(self._counts[nz]) / self._total
        return values, frac

    # -- serialisation --------------------------------------------------------------------

    def to_dict(self) -> dict[str, object]:
        """Sparse, JSON-friendly form: bucket index -> count."""
        nz = np.nonzero(self._counts)[0]
        return {
            "significant_digits": self.significant_digits,
            "sum": self._sum,
            "min": self._min,
            "max": self._max,
            "buckets": [[int(i), int(self._counts[i])] for i in nz],
        }

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Histogram:
        digits = data["significant_digits"]
        buckets = data["buckets"]
        if not isinstance(digits, int) or not isinstance(buckets, list):
            raise ValueError("bad histogram data")
        h = cls(digits)
        for i, n in buckets:
            h._grow(int(i))
            h._counts[int(i)] += int(n)
            h._total += int(n)
        s, lo, hi = data.get("sum"), data.get("min"), data.get("max")
        h._sum = int(s) if isinstance(s, int) else 0
        h._min = int(lo) if isinstance(lo, int) else None
        h._max = int(hi) if isinstance(hi, int) else None
        return h
