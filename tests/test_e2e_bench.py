"""End to end on real P1D1: a small seeded closed-loop replay through the router.

Every request succeeds, every reported cached_tokens equals the workload's
expectation after the seed phase, and each request is joined with its timeline.
"""

from __future__ import annotations

import pytest
from e2e import p1d1_spec, run_with, shared_cluster

from pdcluster.cluster.replay.run import BenchConfig, report, run_bench

# One P1D1 with the other modules so marked (tests/e2e.py shared_cluster).
pytestmark = [pytest.mark.e2e, pytest.mark.local_ray, pytest.mark.shared_cluster("p1d1")]


@pytest.fixture(scope="module")
def cluster():
    return shared_cluster("p1d1", p1d1_spec)


@pytest.fixture(scope="module")
def bench(cluster, tmp_path_factory):
    cfg = BenchConfig(base_url=cluster.url, input_len=2100, shared_prefix_ratio=1920 / 2100, output_len=8,
                      num_prefixes=2, num_requests=8, max_concurrency=4, warmup=1, progress=False,
                      out=str(tmp_path_factory.mktemp("bench") / "run"), metric_percentiles=(50.0, 90.0),
                      goodput_ms={"ttft": 60_000.0, "e2el": 0.001})
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
    # vllm bench serve's result options: p50/p90 of TTFT, TPOT and ITL; no request ends in 1 us.
    slo = summary["slo"]
    assert slo["phase"] == "formal" and set(slo["percentiles"]) == {"ttft", "tpot", "itl"}
    assert 0 < slo["percentiles"]["ttft"]["p50"] <= slo["percentiles"]["ttft"]["p90"]
    assert (slo["good_requests"], slo["requests"], slo["goodput_per_s"]) == (0, 8, 0.0)
    assert "goodput (TTFT <= 60000 ms and E2EL <= 0.001 ms): 0 of 8 requests" in report(bench)


# ---- issue 18 item 4, small: fit on this module's runs, predict another load, run it, compare ------

# Besides this module's replay (2,100-token prompts, 180 new over 1,920 cached), one more load for
# the fit: another prompt shape, so that the weights, attention over the new tokens and over the
# history are told apart (a cold 4,096-token seed, then 512 new tokens over 3,584 cached), open
# loop, so that D's steps are seen at 1-3 requests of 4K while P prefills, as the predicted load
# has them (closed-loop fits came out -38% and +38% on TPOT: D's steps in a served load are not
# those of a replay that waits for each answer).
FIT_LOAD = dict(input_len=4096, shared_prefix_ratio=3584 / 4096, output_len=24, num_prefixes=1, num_requests=10,
                max_concurrency=3, request_rate=3.0, seed=21)
# The load predicted: another shape (c90-tiny's: 388 new tokens over 3,712 cached), longer outputs,
# more in flight, an arrival rate.
PREDICTED_LOAD = dict(input_len=4100, shared_prefix_ratio=3712 / 4100, output_len=24, num_prefixes=2,
                      num_requests=16, max_concurrency=3, request_rate=3.0, seed=22)
# The prediction's tolerance on the means, per metric. docs/sim.md "Validation against real
# engines" measures what it can be on this 2-core machine: two real runs of one load minutes apart
# differ by ~20%, and a fit's loads that happen to run in a slow moment carry it into the
# prediction (one run here: a cold 4,096-token prefill took 1.04 s during the fit, 0.46 s in the
# others; TTFT then came out +37%). What the model leaves out makes TTFT low by ~10% (the request's
# way outside the engines' steps, ~14 ms) and TPOT low under contention (the router, client and
# Ray share the cores with the pinned engines; every running request's token goes through them).
# Measured on 2026-12-04: five runs of this module alone at load averages 4-11, TTFT -19% to +37%,
# TPOT -18% to +22%, E2E -16% to +6%; on a quiet machine -13.5%, -0.7%, -6.1%; in a full clean-clone
# suite run -14.7%, -34.9%, -27.7%. So 50% on each: it still catches what moves a prediction by half
# or more (the base file's guessed numbers are off by 65-132% on TPOT, a fit that fails, a unit gone
# wrong, a fitted number lost on its way to the file); finer errors are below what one run here tells.
PREDICTION_TOLERANCE = {"TTFT mean": 0.5, "TPOT mean": 0.5, "E2E mean": 0.5}


def test_a_fit_of_this_run_predicts_another_load_within_the_stated_tolerance(cluster, bench, tmp_path):
    import dataclasses

    from pdcluster.bench.sim_validation import fit_tiny
    from pdcluster.cluster.sim.fit_output import fitted_yaml, residual_summary
    from pdcluster.cluster.sim.virtual.agreement import compare, format_agreement
    from pdcluster.cluster.sim.virtual.run import simulate
    from pdcluster.proto.spec import SHIPPED_SIM_PARAMS

    fit_load = run_bench(BenchConfig(base_url=cluster.url, progress=False, out=str(tmp_path / "fit"), **FIT_LOAD),
                         log=lambda m: None)
    result = fit_tiny(run_with(cluster.run_dir, [r.request_id for r in fit_load.results]), 128)
    fitted = tmp_path / "fitted.yaml"
    fitted.write_text(fitted_yaml((SHIPPED_SIM_PARAMS / "tiny-qwen3-cpu.yaml").read_text(), result.numbers,
                                  "fitted", "this module's run"))
    cfg = BenchConfig(base_url=cluster.url, progress=False, out=str(tmp_path / "real"), **PREDICTED_LOAD)
    predicted = simulate(cluster.spec, dataclasses.replace(cfg, out=None), params=str(fitted))
    real = run_bench(cfg, log=lambda m: None)
    agreement = compare(real.summaries["formal"], predicted.summaries["formal"])
    fitted_numbers = ", ".join(f"{n.name.split('.')[1]} {n.value:.4g}" for n in result.numbers)
    table = (f"{format_agreement(agreement, 'real', 'predicted')}\nfit: {fitted_numbers}; residuals: prefill "
             f"{residual_summary(result.prefill_residuals)}; decode {residual_summary(result.decode_residuals)}")
    print(table)
    for label, tolerance in PREDICTION_TOLERANCE.items():
        assert abs(agreement.figure(label).rel_diff) <= tolerance, (
            f"{label} predicted off by more than {tolerance:.0%}: the fit or the virtual clock went wrong, or "
            f"this machine was much slower (or faster) during the fit than during the run\n{table}")


def test_the_timeline_summary_reads_the_replays_formal_window_and_gives_its_ttft(bench, capsys):
    """Issue 28 item 2: `pdc timeline summary RUN` (what the demo suggests after its replay) on
    the cluster's run directory, which holds other modules' requests too: the formal window of
    this replay, the same server TTFT as the replay's own breakdown."""
    from pdcluster.cluster.cli import main
    from pdcluster.cluster.replay.outputs import format_phase_breakdown

    joined = [bench.timelines[r.request_id] for r in bench.results if r.phase == "formal"]
    replay_ms = float(format_phase_breakdown(joined).split("TTFT (server)")[1].split()[0])
    capsys.readouterr()
    from pdcluster.proto.load_phases import replay_of

    # The run holds this module's other replays (the fit's) and other modules' requests: name
    # this replay (the default reads the last one).
    replay = replay_of(bench.results[0].request_id)
    main(["timeline", "summary", _run_dir(bench), "--replay", replay])
    out = capsys.readouterr().out
    assert out.startswith(f"window: the formal phase of replay {replay}") and "(8 of " in out.splitlines()[0]
    ttft_row = next(ln for ln in out.splitlines() if ln.split()[:1] == ["TTFT"] and "critical" not in ln).split()
    assert ttft_row[1] == "8" and abs(float(ttft_row[2]) - replay_ms) < 0.01, (ttft_row, replay_ms)


def _run_dir(bench) -> str:
    import json

    return json.loads((bench.out_dir / "summary.json").read_text())["config"]["timeline_run_dir"]


def test_a_trace_arriving_at_once_has_all_64_in_flight_on_real_engines(cluster, tmp_path):
    """Issue 28 item 1, on real engines: 64 requests with one timestamp are sent at once (no
    silent cap of 8): the router held all 64 at the same moment, each of them answered."""
    import json

    from pdcluster.cluster.sim.plan_headroom import _peak_in_flight

    trace = tmp_path / "trace.jsonl"
    # Each its own 1,024-token prompt (two 512-token hash ids), 160 tokens out: P takes ~0.1 s a
    # prompt and D ~10 ms a token, so the first answers long after the last was sent (a clean
    # clone saw the router take the 64th 35 ms after the first had finished with 2 tokens out,
    # and 16 ms after with 16; 64 failed once in an ad-hoc run beside nothing else: taking 64
    # connections in competes with P and D for two cores).
    trace.write_text("".join(json.dumps({"timestamp": 0, "input_length": 1024, "output_length": 160,
                                         "hash_ids": [10_000 + 2 * i, 10_001 + 2 * i]}) + "\n" for i in range(64)))
    cfg = BenchConfig(base_url=cluster.url, trace=str(trace), max_concurrency=None, seed_phase=False,
                      progress=False, out=str(tmp_path / "run"))
    run = run_bench(cfg, log=lambda m: None)
    assert len(run.results) == 64 and all(r.ok for r in run.results), [r.error for r in run.results if not r.ok][:3]
    assert _peak_in_flight(run.results) == 64
    records = run_with(cluster.run_dir, [r.request_id for r in run.results]).records
    arrivals = sorted(r.events["arrival"] for r in records)
    first_done = min(r.events["finish"] for r in records)
    assert arrivals[-1] < first_done  # at the router, all 64 at once
