"""The load driver against a fake streaming server: concurrency, pacing, failures."""

from __future__ import annotations

import asyncio

from fake_openai import FakeServerState, serve_fake

from pdcluster.cluster.replay.driver import DriveConfig, run_phase
from pdcluster.cluster.replay.records import BenchRequest


def requests(n: int, output_len: int = 4, prompt_len: int = 8, expected: int | None = None) -> list[BenchRequest]:
    # The first prompt token is the request's index: the fake server keys on it.
    return [BenchRequest(index=i, prompt_token_ids=(i,) + (7,) * (prompt_len - 1), output_len=output_len,
                         expected_cached_tokens=expected) for i in range(n)]


def drive(url: str, reqs, **cfg):
    return asyncio.run(run_phase(reqs, DriveConfig(base_url=url, progress=False, **cfg), "test"))


def test_closed_loop_keeps_at_most_n_in_flight_and_counts_tokens():
    state = FakeServerState(delay_s=0.01, cached_tokens=3)
    with serve_fake(state) as url:
        results = drive(url, requests(12, output_len=5), max_concurrency=3)
    assert state.max_in_flight == 3
    assert [r.index for r in results] == list(range(12))
    for r in results:
        assert r.ok and r.output_tokens == 5 and r.chunk_tokens == [1] * 5 and len(r.chunk_s) == 5
        assert r.request_id == f"cmpl-{r.index}" and r.cached_tokens == 3 and r.prompt_tokens == 8
        assert r.start_s < r.chunk_s[0] <= r.chunk_s[-1] <= r.end_s


def test_fixed_rate_spaces_the_sends():
    state = FakeServerState(delay_s=0.001)
    with serve_fake(state) as url:
        drive(url, requests(5, output_len=1), max_concurrency=5, request_rate=20.0, burstiness=0.0)
    starts = sorted(state.starts.values())
    assert starts[-1] - starts[0] >= 4 * 0.05 * 0.9  # 4 gaps of 1/20 s (a lower bound: never early)


def test_trace_timestamps_pace_the_sends():
    state = FakeServerState(delay_s=0.001)
    reqs = [BenchRequest(i, (i, 7), 1, arrival_s=0.1 * i) for i in range(4)]
    with serve_fake(state) as url:
        drive(url, reqs, max_concurrency=4, follow_timestamps=True)
    assert state.starts[3] - state.starts[0] >= 0.3 * 0.9


def test_failures_are_recorded_and_the_run_completes():
    state = FakeServerState(fail_http={2, 5}, fail_midstream={7})
    with serve_fake(state) as url:
        results = drive(url, requests(9), max_concurrency=4)
    assert len(results) == 9
    errors = {r.index: r.error for r in results if not r.ok}
    assert set(errors) == {2, 5, 7}
    assert errors[2] == "HTTP 500: request 2 refused"
    assert errors[7] == "stream error: decode of 7 failed"
    assert all(r.output_tokens == 4 for r in results if r.ok)


def test_time_bounded_run_stops_sending():
    state = FakeServerState(delay_s=0.05)
    with serve_fake(state) as url:
        results = drive(url, requests(40, output_len=4), max_concurrency=2, duration_s=0.5)
    assert 2 <= len(results) < 40 and all(r.ok for r in results)


def test_unreachable_server_is_an_error_per_request():
    results = drive("http://127.0.0.1:9", requests(3), max_concurrency=2, timeout_s=5)
    assert len(results) == 3 and all(r.error and "ConnectError" in r.error for r in results)


def test_429s_are_counted_apart_from_failures_and_retried_when_asked():
    from pdcluster.cluster.replay.metrics import summarize

    with serve_fake(FakeServerState(reject={1: 1, 3: 5}, fail_http={4})) as url:
        results = drive(url, requests(6), max_concurrency=6)
    by = {r.index: r for r in results}
    assert by[1].rejected and by[1].rejections == 1 and by[1].error == "HTTP 429: request 1: too many in flight"
    summary = summarize(results, "formal")
    assert (summary.failed_requests, summary.rejected_requests, summary.rejections) == (1, 2, 2)
    assert [f.index for f in summary.failures] == [4]
    with serve_fake(FakeServerState(reject={1: 1, 3: 5})) as url:
        results = drive(url, requests(6), max_concurrency=6, retries_after_429=2)
    by = {r.index: r for r in results}
    assert by[1].ok and by[1].rejections == 1 and by[1].output_tokens == 4  # served on its second try
    assert by[3].rejected and by[3].rejections == 3  # two retries, then the third 429 ends it


def test_each_replay_names_its_requests_apart_and_keeps_its_name_across_phases():
    import dataclasses

    a, b = DriveConfig(base_url="x"), DriveConfig(base_url="x")
    assert a.replay_token != b.replay_token and len(a.replay_token) == 8
    assert dataclasses.replace(a, request_rate=None).replay_token == a.replay_token  # a phase's own settings
