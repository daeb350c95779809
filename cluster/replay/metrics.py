"""AISBench-compatible metrics over `RequestResult`s: pure functions, no I/O.

The formulas follow AISBench's base_perf_metric_calculator so our figures can
sit beside a user's AISBench figures; each is documented next to its code.
All times are client-side `time.monotonic()` seconds (records.py); conversion
to ms happens only when printing (outputs.py).

Phases are summarized apart; warmup is excluded from everything. Failed
requests are counted and listed in `PhaseSummary.failures`, never silently
dropped, but they do not enter the latency/token statistics (as in AISBench,
which computes those "over successful requests").
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from pdcluster.cluster.replay.records import RequestResult

# The per-request metrics AISBench tabulates, in its row order (plus ITL).
METRICS: tuple[str, ...] = (
    "E2EL", "TTFT", "TPOT", "ITL", "InputTokens", "OutputTokens", "PrefillTokenThroughput", "OutputTokenThroughput",
)
# Unit of each metric as stored (seconds); LATENCY_METRICS are shown in ms.
UNITS: dict[str, str] = {
    "E2EL": "s", "TTFT": "s", "TPOT": "s", "ITL": "s", "InputTokens": "tokens", "OutputTokens": "tokens",
    "PrefillTokenThroughput": "tokens/s", "OutputTokenThroughput": "tokens/s",
}
LATENCY_METRICS = frozenset({"E2EL", "TTFT", "TPOT", "ITL"})


@dataclass(frozen=True)
class PerRequestMetrics:
    e2el_s: float
    ttft_s: float | None  # None: no streamed chunk carried a token
    tpot_s: float | None  # None: fewer than 2 output tokens (or no TTFT)
    itl_s: list[float]
    input_tokens: int
    output_tokens: int
    prefill_tps: float | None  # input tokens / TTFT
    output_tps: float | None  # output tokens / E2EL


@dataclass(frozen=True)
class Stats:
    avg: float | None  # all None when n == 0
    min: float | None
    max: float | None
    p50: float | None
    p75: float | None
    p90: float | None
    p99: float | None
    n: int


class Failure(NamedTuple):
    index: int
    request_id: str | None
    error: str


@dataclass
class PhaseSummary:
    phase: str
    total_requests: int
    failed_requests: int  # not counting the rejected
    success_requests: int
    rejected_requests: int  # ended with a 429 (admission control)
    rejections: int  # every 429 received, retried ones included
    benchmark_duration_s: float
    concurrency: float | None  # average requests in flight
    max_concurrency: int | None  # the configured limit, as passed in
    request_throughput_per_s: float | None
    total_input_tokens: int
    total_generated_tokens: int
    input_token_throughput_tokens_per_s: float | None
    output_token_throughput_tokens_per_s: float | None
    total_token_throughput_tokens_per_s: float | None
    stats: dict[str, Stats]  # METRICS name -> Stats, in the unit of UNITS
    measured_hit_ratio: float | None
    measured_hit_requests: int  # successful requests that reported cached_tokens
    expected_hit_ratio: float | None
    expected_hit_requests: int  # successful requests whose expected hit is known
    cache_mismatches: int  # successful requests with both known and cached != expected
    failures: list[Failure] = field(default_factory=list)


def per_request(r: RequestResult) -> PerRequestMetrics:
    """One request's AISBench metrics (meaningful for successful requests)."""
    # E2EL = end - start.
    e2el = r.end_s - r.start_s
    # TTFT = arrival of the first chunk carrying tokens - start (role-only or
    # empty chunks are not in chunk_s, so they cannot fake an early first token).
    ttft = r.chunk_s[0] - r.start_s if r.chunk_s else None
    # OutputTokens: the server's usage count; the streamed chunks' sum only when
    # usage was missing (0), so a lost usage block does not zero the request.
    out = r.output_tokens or sum(r.chunk_tokens)
    # TPOT = (E2EL - TTFT) / (OutputTokens - 1): decode time per token after the
    # first; undefined with a single output token.
    tpot = (e2el - ttft) / (out - 1) if ttft is not None and out >= 2 else None
    # ITL = gaps between consecutive token-carrying chunks (per chunk, not per
    # token: a chunk of several tokens is one gap, as AISBench counts it).
    itl = [b - a for a, b in zip(r.chunk_s, r.chunk_s[1:])]
    # PrefillTokenThroughput = InputTokens / TTFT.
    prefill_tps = r.prompt_tokens / ttft if ttft else None
    # OutputTokenThroughput (per request) = OutputTokens / E2EL.
    output_tps = out / e2el if e2el > 0 else None
    return PerRequestMetrics(e2el, ttft, tpot, itl, r.prompt_tokens, out, prefill_tps, output_tps)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """numpy.percentile's default ("linear"): rank h = (n-1)*q/100, then
    interpolate between the values at floor(h) and floor(h)+1."""
    n = len(sorted_values)
    h = (n - 1) * q / 100
    lo = math.floor(h)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (h - lo) * (sorted_values[hi] - sorted_values[lo])


def stats(values: Iterable[float]) -> Stats:
    """Average, Min, Max, Median(P50), P75, P90, P99 (linear percentiles) and N."""
    v = sorted(values)
    if not v:
        return Stats(None, None, None, None, None, None, None, 0)
    return Stats(sum(v) / len(v), v[0], v[-1], percentile(v, 50), percentile(v, 75), percentile(v, 90),
                 percentile(v, 99), len(v))


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def summarize(results: Iterable[RequestResult], phase: str, max_concurrency: int | None = None) -> PhaseSummary:
    """The AISBench common metrics and per-metric stats of one phase's requests."""
    if phase == "warmup":
        # Warmup exists to fill caches and JIT paths; its figures would mislead.
        raise ValueError("the warmup phase is not summarized")
    rs = [r for r in results if r.phase == phase]
    ok = [r for r in rs if r.ok]
    per = [per_request(r) for r in ok]

    # Benchmark Duration = last end - first start over every request of the
    # phase, failed ones included: they occupied the window too.
    duration = max(r.end_s for r in rs) - min(r.start_s for r in rs) if rs else 0.0

    metric_values: dict[str, list[float]] = {
        "E2EL": [p.e2el_s for p in per],
        "TTFT": [p.ttft_s for p in per if p.ttft_s is not None],
        "TPOT": [p.tpot_s for p in per if p.tpot_s is not None],
        # ITL pools every gap of every successful request into one distribution.
        "ITL": [gap for p in per for gap in p.itl_s],
        "InputTokens": [p.input_tokens for p in per],
        "OutputTokens": [p.output_tokens for p in per],
        "PrefillTokenThroughput": [p.prefill_tps for p in per if p.prefill_tps is not None],
        "OutputTokenThroughput": [p.output_tps for p in per if p.output_tps is not None],
    }

    # Total Input / Generated Tokens: over successful requests only.
    total_in = sum(p.input_tokens for p in per)
    total_out = sum(p.output_tokens for p in per)

    # Hit ratios over successful requests, each over those that know it:
    # measured = sum(cached) / sum(prompt) where the server reported cached_tokens;
    # expected = sum(expected_cached) / sum(prompt) where the workload knows it.
    measured = [r for r in ok if r.cached_tokens is not None]
    expected = [r for r in ok if r.expected_cached_tokens is not None]
    mismatches = sum(1 for r in ok if r.cached_tokens is not None and r.expected_cached_tokens is not None
                     and r.cached_tokens != r.expected_cached_tokens)

    return PhaseSummary(
        phase=phase,
        total_requests=len(rs),
        failed_requests=sum(1 for r in rs if not r.ok and not r.rejected),
        success_requests=len(ok),
        rejected_requests=sum(1 for r in rs if r.rejected),
        rejections=sum(r.rejections for r in rs),
        benchmark_duration_s=duration,
        # Concurrency (average) = sum(E2EL of successful requests) / duration.
        concurrency=_ratio(sum(p.e2el_s for p in per), duration),
        max_concurrency=max_concurrency,
        # Request Throughput = successful requests / duration.
        request_throughput_per_s=_ratio(len(ok), duration),
        total_input_tokens=total_in,
        total_generated_tokens=total_out,
        # Input / Output / Total Token Throughput = tokens / duration.
        input_token_throughput_tokens_per_s=_ratio(total_in, duration),
        output_token_throughput_tokens_per_s=_ratio(total_out, duration),
        total_token_throughput_tokens_per_s=_ratio(total_in + total_out, duration),
        stats={name: stats(metric_values[name]) for name in METRICS},
        measured_hit_ratio=_ratio(sum(r.cached_tokens for r in measured), sum(r.prompt_tokens for r in measured)),
        measured_hit_requests=len(measured),
        expected_hit_ratio=_ratio(sum(r.expected_cached_tokens for r in expected),
                                  sum(r.prompt_tokens for r in expected)),
        expected_hit_requests=len(expected),
        cache_mismatches=mismatches,
        failures=[Failure(r.index, r.request_id, r.error) for r in rs if not r.ok and not r.rejected],
    )


def summarize_phases(results: Sequence[RequestResult], max_concurrency: int | None = None) -> dict[str, PhaseSummary]:
    """One summary per non-warmup phase present, in the order phases first appear."""
    phases = dict.fromkeys(r.phase for r in results if r.phase != "warmup")
    return {p: summarize(results, p, max_concurrency) for p in phases}
