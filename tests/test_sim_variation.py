"""Step-time variation (cluster/sim/variation.py) and its measurement (cluster/sim/fit_variation.py):
draws that depend on the step's index only, a mean of 1, runs of repeated steps unchanged by it,
and the spreads a run was made with read back from its records."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from pdcluster.cluster.cli import main
from pdcluster.cluster.replay.run import BenchConfig
from pdcluster.cluster.sim.cost import SimParams
from pdcluster.cluster.sim.fit_variation import drift_of, measure
from pdcluster.cluster.sim.sim_params import Variation
from pdcluster.cluster.sim.variation import StepVariation, normals
from pdcluster.cluster.sim.virtual.prompts import PromptCache
from pdcluster.cluster.sim.virtual.run import simulate, write_virtual_run
from pdcluster.proto.spec import SHIPPED_SIM_PARAMS, parse_spec
from pdcluster.router.run_store import load_run

TRUTH = Variation(decode_sd=0.25, drift_sd=0.15, drift_steps=40, prefill_sd=0.1)


def varied_params(tmp: Path, variation: Variation) -> Path:
    data = SimParams.load(SHIPPED_SIM_PARAMS / "tiny-qwen3-cpu.yaml").model_dump()
    data["variation"] = variation.model_dump()
    (tmp / "varied.yaml").write_text(yaml.safe_dump(data))
    return tmp / "varied.yaml"


def p1d1(params: Path):
    return parse_spec({
        "name": "varied", "model": {"path": "/nonexistent"},
        "engine": {"kind": "sim", "block_size": 128, "max_model_len": 8192, "max_num_batched_tokens": 8192},
        "sim": {"params": str(params)}, "prefill": {"instances": 1}, "decode": {"instances": 1},
        "router": {"policy": "prefix_aware"}})


# c90-tiny's shape, outputs of 96 tokens: a few D steps' windows per request.
LOAD = BenchConfig(input_len=4100, shared_prefix_ratio=3712 / 4100, output_len=96, num_prefixes=4, num_requests=60,
                   max_concurrency=6, request_rate=3.0, progress=False)


def test_the_draws_are_standard_normal_and_a_function_of_key_counter_and_stream():
    z = normals(7, np.arange(200_000), 0)
    assert abs(z.mean()) < 0.01 and abs(z.std() - 1) < 0.01
    assert np.array_equal(z[1000:1010], normals(7, np.arange(1000, 1010), 0))
    assert not np.array_equal(z[:10], normals(8, np.arange(10), 0))
    assert not np.array_equal(z[:10], normals(7, np.arange(10), 2))


def test_a_steps_factor_depends_on_its_index_only_and_averages_one():
    v = StepVariation(TRUTH, "decode-0")
    durations = [0.01 + 1e-5 * k for k in range(50)]
    whole = v.apply(durations, 100, decode=True)
    assert whole == v.apply(durations[:7], 100, decode=True) + v.apply(durations[7:], 107, decode=True)
    factors = np.array(v.apply([1.0] * 100_000, 0, decode=True))
    assert factors.mean() == pytest.approx(1, abs=0.01)
    assert np.log(factors).std() == pytest.approx(np.hypot(0.25, 0.15), rel=0.05)
    assert v.apply(durations, 0, decode=True) != StepVariation(TRUTH, "decode-1").apply(durations, 0, decode=True)
    assert StepVariation(Variation(), "decode-0").apply(durations, 3, decode=True) == durations


def test_repeated_decode_steps_give_exactly_the_varied_steps_one_by_one(tmp_path):
    spec = p1d1(varied_params(tmp_path, TRUTH))
    prompts = PromptCache(128)
    once = simulate(spec, LOAD, prompts=prompts, vocab_size=1000)
    stepped = simulate(spec, LOAD, prompts=prompts, repeat_steps=False, vocab_size=1000)
    assert [r.to_json() for r in once.records] == [r.to_json() for r in stepped.records]
    assert sum(i.step_events for i in once.instances) < sum(i.steps for i in once.instances) / 3


def test_the_drift_and_its_window_are_read_from_the_autocovariance():
    rng = np.random.default_rng(0)
    series = []
    for _ in range(400):  # per request: 120 steps, windows of 30 at a random phase
        drift = np.repeat(rng.normal(0, 0.2, 6), 30)[rng.integers(0, 30):][:120]
        series.append(drift + rng.normal(0, 0.3, len(drift)))
    var, window, cov = drift_of(series)
    assert np.sqrt(var) == pytest.approx(0.2, rel=0.1) and window == pytest.approx(30, rel=0.2)
    assert cov[0] == pytest.approx(0.2 ** 2 + 0.3 ** 2, rel=0.1)


def test_a_runs_variation_is_measured_back(tmp_path):
    params = varied_params(tmp_path, TRUTH)
    write_virtual_run(simulate(p1d1(params), LOAD, vocab_size=1000), tmp_path / "run")
    got = measure(load_run(tmp_path / "run" / "timeline"), SimParams.load(params))
    # Measured 0.249, 0.153, 46 steps, 0.098 (60 prefills).
    assert got.decode_sd == pytest.approx(TRUTH.decode_sd, rel=0.05)
    assert got.drift_sd == pytest.approx(TRUTH.drift_sd, rel=0.1)
    assert got.drift_steps == pytest.approx(TRUTH.drift_steps, rel=0.25)
    assert got.prefill_sd == pytest.approx(TRUTH.prefill_sd, rel=0.25)
    assert got.decode_gaps > 4000
    # A run without variation: none read.
    write_virtual_run(simulate(p1d1(varied_params(tmp_path, Variation())), LOAD, vocab_size=1000), tmp_path / "flat")
    flat = measure(load_run(tmp_path / "flat" / "timeline"), SimParams.load(tmp_path / "varied.yaml"))
    assert flat.decode_sd < 0.01 and flat.drift_sd < 0.01 and flat.prefill_sd < 0.01


def test_pdc_sim_fit_writes_the_measured_variation_into_the_fitted_file(tmp_path, capsys):
    params = varied_params(tmp_path, TRUTH)
    write_virtual_run(simulate(p1d1(params), LOAD, vocab_size=1000), tmp_path / "run")
    out = tmp_path / "fitted.yaml"
    main(["sim", "fit", str(tmp_path / "run" / "timeline"), "--params", "tiny-qwen3-cpu", "--out", str(out)])
    assert "D steps 0.2" in capsys.readouterr().out  # the printed decode_sd, 0.25 measured as 0.249
    fitted = SimParams.load(out)
    assert fitted.variation.decode_sd == pytest.approx(TRUTH.decode_sd, rel=0.05)
    assert fitted.variation.drift_steps == pytest.approx(TRUTH.drift_steps, rel=0.25)
    # The shipped base has no variation section: added at the end, each number sourced.
    lines = out.read_text().splitlines()
    at = lines.index("variation:")
    assert [ln.split(":")[0].strip() for ln in lines[at + 1:at + 5]] == ["decode_sd", "drift_sd", "drift_steps",
                                                                        "prefill_sd"]
    assert all("[fit] run varied-virtual" in ln for ln in lines[at + 1:at + 5])
    # The load again with the fitted file: TPOT's mean and spread as the run's (measured: mean
    # +6.3%, p90/p50 1.195 against 1.173). The mean is the fit's: slow phases leave more requests
    # on D, so the fit sees the drift in the larger batches' steps and gives them a steeper slope
    # (its D step at batch 1 ~11% short, at 3 ~4%).
    truth = simulate(p1d1(params), LOAD, vocab_size=1000).summaries["formal"].stats["TPOT"]
    again = simulate(p1d1(out), LOAD, vocab_size=1000).summaries["formal"].stats["TPOT"]
    assert again.avg == pytest.approx(truth.avg, rel=0.1)
    assert again.p90 / again.p50 == pytest.approx(truth.p90 / truth.p50, rel=0.05)
    main(["sim", "fit", str(tmp_path / "run" / "timeline"), "--params", "tiny-qwen3-cpu", "--out", str(out),
          "--no-variation"])
    assert SimParams.load(out).variation == Variation()
