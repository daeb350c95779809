"""bench.metrics: every AISBench formula on hand-made results with hand-computed values.

Times are binary fractions (0.25, 0.5, ...) so most expected values are exact;
approx only guards the few sums and divisions that are not.
"""

from __future__ import annotations

import pytest

from pdcluster.cluster.replay.metrics import Failure, per_request, percentile, stats, summarize, summarize_phases
from pdcluster.cluster.replay.records import RequestResult


def res(index, start, end, chunks=(), tokens=(), prompt=100, out=None, phase="formal", error=None,
        request_id=None, cached=None, expected=None) -> RequestResult:
    return RequestResult(index=index, phase=phase, prompt_tokens=prompt, start_s=start, end_s=end,
                         request_id=request_id or f"r-{index}", chunk_s=list(chunks), chunk_tokens=list(tokens),
                         output_tokens=sum(tokens) if out is None else out, cached_tokens=cached,
                         expected_cached_tokens=expected, error=error)


# A: 3 tokens in 3 chunks; B: 5 tokens in 3 chunks; C: one token; D: failed, ends last.
A = res(0, 0.0, 1.0, chunks=(0.5, 0.75, 1.0), tokens=(1, 1, 1), prompt=128, cached=96, expected=96)
B = res(1, 0.5, 2.5, chunks=(1.0, 2.0, 2.5), tokens=(1, 2, 2), prompt=256, cached=0, expected=192)
C = res(2, 1.0, 1.5, chunks=(1.25,), tokens=(1,), prompt=64)
D = res(3, 0.25, 4.0, prompt=80, error="HTTP 500: boom", expected=32)
WARM = res(9, -10.0, 100.0, chunks=(-9.0, -8.0), tokens=(1, 1), prompt=999, phase="warmup", cached=0, expected=999)
CHECK = res(5, 10.0, 12.0, chunks=(11.0, 11.5), tokens=(1, 1), prompt=32, phase="check")
RUN = [WARM, A, B, CHECK, C, D]


def test_per_request_formulas():
    m = per_request(A)
    assert m.e2el_s == 1.0  # end - start
    assert m.ttft_s == 0.5  # first chunk - start
    assert m.tpot_s == 0.25  # (1.0 - 0.5) / (3 - 1)
    assert m.itl_s == [0.25, 0.25]  # gaps between chunks
    assert (m.input_tokens, m.output_tokens) == (128, 3)
    assert m.prefill_tps == 256.0  # 128 / 0.5
    assert m.output_tps == 3.0  # 3 / 1.0

    m = per_request(B)
    assert (m.e2el_s, m.ttft_s, m.tpot_s, m.itl_s) == (2.0, 0.5, 0.375, [1.0, 0.5])  # tpot (2.0-0.5)/(5-1)
    assert (m.prefill_tps, m.output_tps) == (512.0, 2.5)


def test_single_output_token_has_no_tpot_and_no_itl():
    m = per_request(C)
    assert (m.e2el_s, m.ttft_s, m.tpot_s, m.itl_s) == (0.5, 0.25, None, [])
    assert (m.prefill_tps, m.output_tps) == (256.0, 2.0)


def test_output_tokens_fall_back_to_chunks_when_usage_missing():
    r = res(0, 0.0, 1.0, chunks=(0.5, 1.0), tokens=(2, 3), out=0)
    assert per_request(r).output_tokens == 5
    assert per_request(res(0, 0.0, 1.0, chunks=(0.5,), tokens=(1,), out=7)).output_tokens == 7  # usage wins


def test_no_token_chunk_means_no_ttft():
    m = per_request(res(0, 0.0, 1.0, out=0))
    assert (m.ttft_s, m.tpot_s, m.prefill_tps, m.itl_s) == (None, None, None, [])


def test_stats_linear_percentiles_by_hand():
    s = stats([10, 1, 4, 2, 3])  # sorted 1 2 3 4 10; rank h = 4 * q / 100
    assert (s.avg, s.min, s.max, s.n) == (4.0, 1, 10, 5)
    assert s.p50 == 3  # h = 2
    assert s.p75 == 4  # h = 3
    assert s.p90 == pytest.approx(7.6)  # h = 3.6: 4 + 0.6 * (10 - 4)
    assert s.p99 == pytest.approx(9.76)  # h = 3.96: 4 + 0.96 * 6
    s = stats([1, 2, 3, 4])  # h = 3 * q / 100
    assert (s.p50, s.p75) == (2.5, 3.25)  # h = 1.5, 2.25
    assert s.p90 == pytest.approx(3.7) and s.p99 == pytest.approx(3.97)  # h = 2.7, 2.97


def test_percentile_matches_numpy_default():
    np = pytest.importorskip("numpy")
    values = sorted([0.3, 7.0, 1.5, 2.25, 9.0, 4.0, 0.01])
    for q in (0, 25, 50, 75, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_stats_of_nothing_and_of_one():
    assert stats([]).n == 0 and stats([]).avg is None and stats([]).p99 is None
    s = stats([2.5])
    assert (s.avg, s.min, s.max, s.p50, s.p75, s.p90, s.p99, s.n) == (2.5,) * 7 + (1,)


def test_summary_common_metrics():
    s = summarize(RUN, "formal", max_concurrency=4)
    assert (s.total_requests, s.failed_requests, s.success_requests) == (4, 1, 3)
    assert s.benchmark_duration_s == 4.0  # last end (D, failed: 4.0) - first start (A: 0.0); warmup ignored
    assert s.concurrency == 0.875  # (1.0 + 2.0 + 0.5) / 4.0
    assert s.max_concurrency == 4
    assert s.request_throughput_per_s == 0.75  # 3 / 4.0
    assert (s.total_input_tokens, s.total_generated_tokens) == (448, 9)  # 128+256+64; 3+5+1 (D excluded)
    assert s.input_token_throughput_tokens_per_s == 112.0  # 448 / 4
    assert s.output_token_throughput_tokens_per_s == 2.25  # 9 / 4
    assert s.total_token_throughput_tokens_per_s == 114.25  # 457 / 4


def test_summary_stats_exclude_failed_and_pool_itl():
    st = summarize(RUN, "formal").stats
    assert st["E2EL"].n == 3 and st["E2EL"].max == 2.0  # D's 3.75 s is not a latency sample
    assert sorted(st) == sorted(["E2EL", "TTFT", "TPOT", "ITL", "InputTokens", "OutputTokens",
                                 "PrefillTokenThroughput", "OutputTokenThroughput"])
    assert (st["TTFT"].min, st["TTFT"].p50, st["TTFT"].max) == (0.25, 0.5, 0.5)
    assert (st["TPOT"].n, st["TPOT"].avg) == (2, 0.3125)  # A 0.25, B 0.375; C has none
    itl = st["ITL"]  # A [0.25, 0.25] + B [1.0, 0.5] pooled: 0.25 0.25 0.5 1.0, h = 3q/100
    assert (itl.n, itl.avg, itl.min, itl.max, itl.p50) == (4, 0.5, 0.25, 1.0, 0.375)
    assert itl.p75 == 0.625  # h = 2.25: 0.5 + 0.25 * 0.5
    assert itl.p90 == pytest.approx(0.85) and itl.p99 == pytest.approx(0.985)  # h = 2.7, 2.97
    assert (st["InputTokens"].avg, st["OutputTokens"].avg) == (448 / 3, 3.0)
    assert (st["PrefillTokenThroughput"].min, st["PrefillTokenThroughput"].max) == (256.0, 512.0)
    assert st["OutputTokenThroughput"].p50 == 2.5  # 2.0 2.5 3.0


def test_failures_listed_with_errors():
    s = summarize(RUN, "formal")
    assert s.failures == [Failure(3, "r-3", "HTTP 500: boom")]
    assert s.failures[0] == (3, "r-3", "HTTP 500: boom")  # also a plain (index, request_id, error) tuple


def test_hit_ratios_and_mismatches():
    s = summarize(RUN, "formal")
    assert (s.measured_hit_ratio, s.measured_hit_requests) == (0.25, 2)  # (96 + 0) / (128 + 256); C unknown
    assert (s.expected_hit_ratio, s.expected_hit_requests) == (0.75, 2)  # (96 + 192) / 384; failed D excluded
    assert s.cache_mismatches == 1  # B: 0 cached, 192 expected


def test_hit_ratios_unknown():
    s = summarize([C], "formal")
    assert (s.measured_hit_ratio, s.expected_hit_ratio, s.cache_mismatches) == (None, None, 0)


def test_phases_apart_and_warmup_excluded():
    chk = summarize(RUN, "check")
    assert (chk.total_requests, chk.benchmark_duration_s, chk.total_input_tokens) == (1, 2.0, 32)
    assert chk.stats["TTFT"].avg == 1.0 and chk.failures == []
    phases = summarize_phases(RUN, max_concurrency=2)
    assert list(phases) == ["formal", "check"]  # no warmup, order of appearance
    assert phases["formal"].total_input_tokens == 448 and phases["check"].max_concurrency == 2
    with pytest.raises(ValueError, match="warmup"):
        summarize(RUN, "warmup")


def test_empty_phase():
    s = summarize(RUN, "seed")
    assert (s.total_requests, s.benchmark_duration_s, s.concurrency, s.request_throughput_per_s) == (0, 0.0, None, None)
    assert s.stats["TTFT"].n == 0


def test_all_failed_phase_still_has_a_duration():
    s = summarize([D], "formal")
    assert (s.total_requests, s.failed_requests, s.benchmark_duration_s) == (1, 1, 3.75)
    assert s.concurrency == 0.0 and s.request_throughput_per_s == 0.0 and s.stats["E2EL"].n == 0
