"""End to end on real P1D1: a small seeded closed-loop replay through the router.

Every request succeeds, every reported cached_tokens equals the workload's
expectation after the seed phase, and each request is joined with its timeline.
"""

from __future__ import annotations

import pytest
from e2e import cluster_spec_for, running_cluster

from pdcluster.bench.run import BenchConfig, report, run_bench

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cluster():
    spec = cluster_spec_for("e2e-bench")
    with running_cluster(spec) as c:
        yield c


@pytest.fixture(scope="module")
def bench(cluster, tmp_path_factory):
    cfg = BenchConfig(base_url=cluster.url, input_len=2100, shared_prefix_ratio=1920 / 2100, output_len=8,
                      num_prefixes=2, num_requests=8, max_concurrency=4, warmup=1, progress=False,
                      out=str(tmp_path_factory.mktemp("bench") / "run"))
    return run_bench(cfg, log=lambda m: None)


def test_every_request_succeeds(bench):
    assert [r.phase for r in bench.results] == ["warmup"] + ["seed"] * 2 + ["check"] * 2 + ["formal"] * 8
    assert all(r.ok for r in bench.results), [r.error for r in bench.results if not r.ok]
    assert all(r.output_tokens == 8 for r in bench.results if r.phase != "warmup")


def test_cached_tokens_match_the_expectation_after_seeding(bench):
    assert bench.hit_mismatches == []
    checked = [r for r in bench.results if r.phase in ("check", "formal")]
    assert all(r.cached_tokens == r.expected_cached_tokens == 1920 for r in checked)
    formal = bench.summaries["formal"]
    assert formal.measured_hit_ratio == formal.expected_hit_ratio == 1920 / 2100


def test_requests_are_joined_with_their_timelines(bench):
    formal = [r for r in bench.results if r.phase == "formal"]
    assert all(r.request_id in bench.timelines for r in formal)
    for r in formal:
        rec = bench.timelines[r.request_id]
        assert rec.p_cached_tokens == r.cached_tokens and rec.output_tokens == 8
        # The server's TTFT (arrival -> first token) sits inside the client's.
        assert (rec.events["first_token"] - rec.events["arrival"]) / 1e9 <= r.chunk_s[0] - r.start_s
    text = report(bench)
    assert "where the formal window's TTFT went" in text and "prefill" in text


def test_outputs_are_written(bench):
    import json

    summary = json.loads((bench.out_dir / "summary.json").read_text())
    assert summary["config"]["timeline_run_dir"]
    lines = [json.loads(l) for l in (bench.out_dir / "requests.jsonl").read_text().splitlines()]
    formal = [l for l in lines if l["phase"] == "formal"]
    assert len(formal) == 8 and all(l["timeline"] and l["timeline"]["complete"] for l in formal)
