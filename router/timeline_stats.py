"""Distributions the timeline views report: durations in ms (nearest-rank percentiles), ratios."""

from __future__ import annotations

from dataclasses import dataclass

NS_PER_MS = 1_000_000


@dataclass(frozen=True)
class Stats:
    """Distribution of one duration over requests, in ms; percentiles are nearest-rank."""

    n: int
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float

    @classmethod
    def of_ns(cls, values: list[int]) -> Stats | None:
        if not values:
            return None
        v = sorted(values)
        return cls(len(v), sum(v) / len(v) / NS_PER_MS, *(percentile(v, p) / NS_PER_MS for p in (50, 90, 99)))


def percentile(sorted_values: list[int], p: int) -> int:
    """Nearest-rank: the smallest value with at least p% of values <= it (integer math: no float ranks)."""
    rank = max(1, (p * len(sorted_values) + 99) // 100)
    return sorted_values[rank - 1]


@dataclass(frozen=True)
class Ratios:
    n: int
    p10: float
    p50: float
    p90: float

    @classmethod
    def of(cls, values: list[float]) -> Ratios | None:
        if not values:
            return None
        v = sorted(values)
        return cls(len(v), v[len(v) // 10], v[len(v) // 2], v[min(len(v) - 1, len(v) * 9 // 10)])
