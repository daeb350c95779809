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


# ---- issue 18 item 4, small: fit on this module's replay, predict another, run it, compare ----------

# The prediction's tolerance on TTFT, TPOT and E2E means. docs/sim.md "Validation against real
# engines" measures why it is this loose on the tiny model here: what a request costs outside
# the engine's steps (router, Ray channel, vLLM's own front end: 15-25 ms, not modelled) is a
# large share of a ~60-130 ms TTFT, and vLLM-CPU's decode steps grow with the batch in host work
# the cost model does not have (the fit's decode residuals ~25%). A tighter bound would fail on
# noise; a looser one would not catch a wrong fit or a broken virtual clock (the base file is off
# by 50% and more on TPOT). Measured once here (2026-12-04): TTFT +45%, TPOT -28%, E2E -10%.
PREDICTION_TOLERANCE = 0.6


def test_a_fit_of_this_run_predicts_another_load_within_the_stated_tolerance(cluster, bench, tmp_path):
    import dataclasses

    from pdcluster.cluster.sim.cost import CostModel, SimParams
    from pdcluster.cluster.sim.fit import fit, observations
    from pdcluster.cluster.sim.virtual.agreement import compare, format_agreement
    from pdcluster.cluster.sim.virtual.run import simulate
    from pdcluster.cluster.spec import SHIPPED_SIM_PARAMS
    from pdcluster.router.timeline import load_run

    base = SimParams.load(SHIPPED_SIM_PARAMS / "tiny-qwen3-cpu.yaml")
    result = fit(base, 128, observations(load_run(cluster.run_dir), CostModel(base, 128)))
    fitted = tmp_path / "fitted.yaml"
    import yaml

    fitted.write_text(yaml.safe_dump(result.params.model_dump()))
    # Another load: the same prompt shape, other families, longer outputs, half the concurrency, a rate.
    cfg = BenchConfig(base_url=cluster.url, input_len=2100, shared_prefix_ratio=1920 / 2100, output_len=24,
                      num_prefixes=2, num_requests=8, max_concurrency=2, request_rate=2.0, seed=5, progress=False,
                      out=str(tmp_path / "real"))
    predicted = simulate(cluster.spec, dataclasses.replace(cfg, out=None), params=str(fitted))
    real = run_bench(cfg, log=lambda m: None)
    agreement = compare(real.summaries["formal"], predicted.summaries["formal"])
    print(format_agreement(agreement, "real", "predicted"))
    for label in ("TTFT mean", "TPOT mean", "E2E mean"):
        f = agreement.figure(label)
        assert abs(f.rel_diff) <= PREDICTION_TOLERANCE, format_agreement(agreement, "real", "predicted")
