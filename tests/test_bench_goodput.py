"""`pdc bench run --percentile-metrics/--metric-percentiles/--goodput` (cluster/replay/goodput.py),
as `vllm bench serve` names them: hand-made results, hand-computed figures, every bad value refused
naming its flag."""

from __future__ import annotations

import pytest
from test_bench_metrics import RUN, A, B, C, D

from pdcluster.cluster.replay.goodput import format_slo, parse_goodput, parse_metrics, parse_percentiles, slo_figures


def test_percentiles_of_the_chosen_metrics():
    # TTFTs A 0.5, B 0.5, C 0.25 s (D failed: no TTFT): p50 500 ms, p100 500 ms.
    f = slo_figures(RUN, "formal", 4.0, ("ttft", "e2el"), (50, 100))
    assert f.percentiles == {"ttft": {"p50": 500.0, "p100": 500.0}, "e2el": {"p50": 1000.0, "p100": 2000.0}}
    assert f.good_requests is None and f.requests == 4


def test_goodput_counts_the_requests_that_met_every_bound_a_failure_none():
    # TTFT <= 500 ms: A, B, C; TPOT <= 300 ms: A (250), C (none: one token, no TPOT -> not met), B (375) no.
    f = slo_figures(RUN, "formal", 4.0, bounds_ms={"ttft": 500, "tpot": 300})
    assert (f.good_requests, f.requests, f.goodput_per_s) == (1, 4, 0.25)
    assert f.goodput_bounds_ms == {"ttft": 500, "tpot": 300}
    assert "goodput (TTFT <= 500 ms and TPOT <= 300 ms): 1 of 4 requests, 0.250 req/s" in format_slo(f)
    assert slo_figures([A, B, C, D], "formal", 4.0, bounds_ms={"e2el": 1000}).good_requests == 2  # A and C


def test_parsing_as_vllm_takes_them():
    assert parse_metrics("ttft,itl") == ("ttft", "itl")
    assert parse_percentiles("50,90,99.9") == (50.0, 90.0, 99.9)
    assert parse_goodput(["ttft:2000", "tpot:6"]) == {"ttft": 2000.0, "tpot": 6.0}


@pytest.mark.parametrize("call, message", [
    (lambda: parse_metrics("ttft,latency"), "--percentile-metrics 'ttft,latency'"),
    (lambda: parse_metrics(""), "--percentile-metrics ''"),
    (lambda: parse_percentiles("0,50"), "--metric-percentiles '0,50'"),
    (lambda: parse_percentiles("101"), "--metric-percentiles '101'"),
    (lambda: parse_percentiles("p99"), "--metric-percentiles 'p99'"),
    (lambda: parse_goodput(["ttft=2000"]), "--goodput 'ttft=2000': KEY:MS"),
    (lambda: parse_goodput(["itl:5"]), "--goodput 'itl:5': KEY:MS"),
    (lambda: parse_goodput(["ttft:fast"]), "'fast' is not a number"),
    (lambda: parse_goodput(["ttft:-1"]), "above 0 ms"),
    (lambda: parse_goodput(["ttft:1", "ttft:2"]), "given twice"),
])
def test_bad_values_are_refused_naming_the_flag(call, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        call()


def test_pdc_bench_run_refuses_them_with_exit_2(capsys):
    from pdcluster.cluster.cli import main

    for argv, message in ((["--percentile-metrics", "latency"], "--percentile-metrics 'latency'"),
                          (["--goodput", "ttft:x"], "--goodput 'ttft:x'")):
        with pytest.raises(SystemExit) as err:
            main(["bench", "run", "--base-url", "http://127.0.0.1:9", *argv])
        assert err.value.code == 2 and message in capsys.readouterr().err, message
