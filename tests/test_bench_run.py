"""`run_bench` end to end against the fake server: phases, outputs, failures, the CLI."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

from fake_openai import FakeServerState, serve_fake

from pdcluster.cluster.replay.run import BenchConfig, build_workload, report, run_bench


def config(url: str, tmp_path, **kw) -> BenchConfig:
    base = dict(base_url=url, input_len=300, shared_prefix_ratio=0.9, output_len=3, num_prefixes=2, num_requests=6,
                max_concurrency=3, out=str(tmp_path / "out"), progress=False)
    return BenchConfig(**{**base, **kw})


def test_phases_outputs_and_hit_check(tmp_path):
    state = FakeServerState(cached_tokens=256)  # what a cache holding the 270-token prefix reports (2 blocks)
    with serve_fake(state) as url:
        run = run_bench(config(url, tmp_path, warmup=2), log=lambda m: None)
    phases = [r.phase for r in run.results]
    assert phases == ["warmup"] * 2 + ["seed"] * 2 + ["check"] * 2 + ["formal"] * 6
    assert set(run.summaries) == {"seed", "check", "formal"}  # warm-up is never summarized
    formal = run.summaries["formal"]
    assert (formal.total_requests, formal.success_requests, formal.failed_requests) == (6, 6, 0)
    assert formal.expected_hit_ratio == 256 / 300 and formal.measured_hit_ratio == 256 / 300
    assert run.hit_mismatches == []
    assert {p.name for p in run.out_dir.iterdir()} == {"summary.json", "summary.csv", "requests.jsonl"}
    lines = (run.out_dir / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 12 and json.loads(lines[-1])["phase"] == "formal"
    assert "every reported cached_tokens matched" in report(run)


def test_wrong_hits_and_failures_are_reported(tmp_path):
    cfg = config("http://unused", tmp_path, seed_phase=False, num_requests=4)
    first_family = build_workload(cfg, vocab_size=1000)[0]
    # The fake server keys failures on a prompt's first token: it fails family 0 (requests 0 and 2).
    state = FakeServerState(cached_tokens=0, fail_http={first_family.prompt_token_ids[0]})
    with serve_fake(state) as url:
        run = run_bench(dataclasses.replace(cfg, base_url=url), log=lambda m: None)
    formal = run.summaries["formal"]
    assert (formal.total_requests, formal.failed_requests) == (4, 2)
    assert sorted(f.index for f in formal.failures) == [0, 2]
    assert all("HTTP 500" in f.error for f in formal.failures)
    # Without a seed phase family 1's second request expects the prefix; the server said 0.
    assert len(run.hit_mismatches) == 1 and "expected 256" in run.hit_mismatches[0]
    text = report(run)
    assert "1 mismatches" in text and "HTTP 500" in text


def test_cli_run_against_the_fake_server(tmp_path):
    state = FakeServerState(cached_tokens=0)
    with serve_fake(state) as url:
        r = subprocess.run([sys.executable, "-m", "pdcluster.cluster.cli", "bench", "run", "--base-url", url,
                            "--input-len", "200", "--shared-prefix-ratio", "0.5", "--output-len", "2",
                            "--num-prefixes", "1", "--num-requests", "3", "--no-seed-phase", "--no-progress",
                            "--out", str(tmp_path / "cli")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "phase formal: 3 requests" in r.stderr and "TTFT" in r.stdout
    summary = json.loads((tmp_path / "cli" / "summary.json").read_text())
    assert summary["config"]["num_requests"] == 3


def test_cli_reports_an_unreachable_server(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pdcluster.cluster.cli", "bench", "run", "--base-url",
                        "http://127.0.0.1:9", "--out", str(tmp_path / "x")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "pdc bench: error" in r.stderr


def test_a_trace_replay_sends_the_whole_trace_unless_told_otherwise(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 10 * i, "input_length": 600, "output_length": 2,
                                         "hash_ids": [i % 3, 100 + i]}) + "\n" for i in range(45)))
    whole = BenchConfig(trace=str(trace), out=str(tmp_path / "out"), progress=False)
    assert len(build_workload(whole, vocab_size=1000)) == 45  # more than a synthetic load's 40
    assert len(build_workload(dataclasses.replace(whole, num_requests=7), vocab_size=1000)) == 7
    assert len(build_workload(BenchConfig(seed_phase=False, progress=False), vocab_size=1000)) == 40


def test_expected_hits_do_not_count_blocks_of_requests_that_failed():
    from pdcluster.cluster.replay.records import BenchRequest, RequestResult
    from pdcluster.cluster.replay.run import expected_after_failures

    prefix = list(range(1, 257))  # two 128-token blocks shared
    reqs = {i: BenchRequest(i, tuple(prefix + [500 + i] * 10), 2, expected_cached_tokens=0 if i == 0 else 256)
            for i in range(3)}

    def result(i: int, ok: bool) -> RequestResult:
        return RequestResult(i, "formal", 266, start_s=float(i), end_s=float(i) + 0.5,
                             expected_cached_tokens=reqs[i].expected_cached_tokens, error=None if ok else "HTTP 500")

    fixed = expected_after_failures([result(0, False), result(1, True), result(2, True)], reqs, 128)
    # The first failed: the second found nothing cached; the third then found the second's blocks.
    assert [r.expected_cached_tokens for r in fixed] == [0, 0, 256]
    assert [reqs[i].expected_cached_tokens for i in range(3)] == [0, 0, 256]
    untouched = [result(0, True), result(1, True)]
    assert expected_after_failures(untouched, reqs, 128) is untouched
