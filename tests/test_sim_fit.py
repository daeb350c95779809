"""`pdc sim fit` (cluster/sim/fit.py): from a run made with known parameters (on the virtual
clock: a Mooncake trace's varied prompts and hits on P2D2), the fit recovers them from the base
file's values, within 2%, and says which ones the run does not determine."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pdcluster.cluster.cli import main
from pdcluster.cluster.replay.run import BenchConfig
from pdcluster.cluster.sim.cost import CostModel, SimParams, SimParamsError
from pdcluster.cluster.sim.fit import FitError, fit, observations, with_numbers
from pdcluster.cluster.sim.virtual.run import simulate, write_virtual_run
from pdcluster.proto.spec import SHIPPED_SIM_PARAMS, parse_spec
from pdcluster.router.run_store import load_run

# The trace's first 100 requests (tests/data/README.md): the run uses 80.
TRACE = Path(__file__).resolve().parent / "data" / "mooncake_synthetic_trace_head100.jsonl"
BASE = "qwen3-0.6b-h200"
# The truth the run is made with: every number moved off the base file's by 15-60%.
TRUTH = {"efficiency.gemm": 0.25, "efficiency.attention": 0.6, "efficiency.attention_history": 0.2,
         "efficiency.memory_bandwidth": 0.55, "overheads.prefill_step_s": 0.03, "overheads.decode_step_s": 0.008}
TOLERANCE = 0.02


@pytest.fixture(scope="module")
def truth_run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("fit")
    truth = with_numbers(SimParams.load(SHIPPED_SIM_PARAMS / f"{BASE}.yaml"), TRUTH)
    (tmp / "truth.yaml").write_text(yaml.safe_dump(truth.model_dump()))
    spec = parse_spec({
        "name": "fit-truth", "model": {"path": "/nonexistent"},
        "engine": {"kind": "sim", "block_size": 128, "max_model_len": 131072, "max_num_batched_tokens": 8192,
                   "max_num_seqs": 16},
        "sim": {"params": str(tmp / "truth.yaml")}, "prefill": {"instances": 2}, "decode": {"instances": 2},
        "router": {"policy": "prefix_aware"}})
    cfg = BenchConfig(trace=str(TRACE), num_requests=80, max_concurrency=32, progress=False)
    write_virtual_run(simulate(spec, cfg, vocab_size=1000), tmp / "run")
    return tmp / "run" / "timeline"


def test_the_fit_recovers_the_parameters_the_run_was_made_with(truth_run):
    base = SimParams.load(SHIPPED_SIM_PARAMS / f"{BASE}.yaml")
    obs = observations(load_run(truth_run), CostModel(base, 128))
    assert len(obs.prefill_s) >= 30 and len(obs.decode_s) >= 300
    result = fit(base, 128, obs)
    got = {n.name: n for n in result.numbers}
    for name, want in TRUTH.items():
        assert got[name].determined and got[name].value == pytest.approx(want, rel=TOLERANCE), (name, got[name])
    # prefill_kv_read barely moves a step (a 40K context's KV read is ~1% of its prefill): kept.
    assert not got["efficiency.prefill_kv_read"].determined
    assert got["efficiency.prefill_kv_read"].value == base.efficiency.prefill_kv_read
    assert abs(result.decode_residuals).max() < 0.01 and abs(result.prefill_residuals).mean() < 0.01
    assert abs(result.base_residuals[1]).mean() > 0.2  # the base file was far off


def test_pdc_sim_fit_writes_a_file_that_loads_with_each_fitted_number_sourced(truth_run, tmp_path, capsys):
    out = tmp_path / "fitted.yaml"
    main(["sim", "fit", str(truth_run), "--params", BASE, "--out", str(out)])
    printed = capsys.readouterr().out
    assert "prefill residuals" in printed and "decode residuals" in printed
    fitted = SimParams.load(out)
    assert fitted.name == "fitted" and fitted.efficiency.gemm == pytest.approx(0.25, rel=TOLERANCE)
    line = next(ln for ln in out.read_text().splitlines() if ln.strip().startswith("gemm:"))
    assert "[fit] run fit-truth-virtual" in line and "(was 0.31)" in line
    assert fitted.model == SimParams.load(SHIPPED_SIM_PARAMS / f"{BASE}.yaml").model  # the shape untouched


def test_bad_input_names_the_problem(truth_run, tmp_path, capsys):
    with pytest.raises(SystemExit) as err:
        main(["sim", "fit", str(tmp_path), "--params", BASE, "--out", str(tmp_path / "x.yaml")])
    assert err.value.code == 2 and "not a run directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["sim", "fit", str(truth_run), "--params", BASE, "--out", str(tmp_path / "x.yaml"), "--free", "gemm"])
    assert "--free gemm: not a fittable number" in capsys.readouterr().err
    base = SimParams.load(SHIPPED_SIM_PARAMS / f"{BASE}.yaml")
    with pytest.raises(FitError, match="not a fittable"):
        fit(base, 128, observations(load_run(truth_run), CostModel(base, 128)), ["model.layers"])


def test_a_fitted_number_the_base_file_leaves_at_its_default_is_written_in_its_section():
    from pdcluster.cluster.sim.fit import FittedNumber
    from pdcluster.cluster.sim.fit_output import fitted_yaml

    text = (SHIPPED_SIM_PARAMS / f"{BASE}.yaml").read_text()
    assert "decode_request_s" not in text  # the H200 file leaves it at 0
    out = fitted_yaml(text, [FittedNumber("overheads.decode_request_s", 0.0, 0.0007, True)], "f", "run r")
    assert SimParams.parse(yaml.safe_load(out)).overheads.decode_request_s == 0.0007
    line = next(ln for ln in out.splitlines() if "decode_request_s" in ln)
    assert line.startswith("  decode_request_s: 0.0007  # [fit] run r (was 0, the default)")


def test_a_fitted_file_says_what_it_was_fitted_to():
    """Issue 27 item 1: the base's own account (sourced, or another fit) is replaced by the fit's."""
    from pdcluster.cluster.sim.fit import FittedNumber
    from pdcluster.cluster.sim.fit_output import fitted_yaml

    text = (SHIPPED_SIM_PARAMS / f"{BASE}.yaml").read_text()
    assert SimParams.parse(yaml.safe_load(text)).about.fitted_to.startswith("../shared/data/calibration/")
    out = fitted_yaml(text, [FittedNumber("overheads.decode_request_s", 0.0, 0.0007, True)], "f", "run r (runs/x)")
    about = SimParams.parse(yaml.safe_load(out)).about
    assert (about.basis, about.fitted_to) == ("fitted", "run r (runs/x)")
    assert about.summary.startswith(f"{BASE} with the numbers marked [fit]") and out.count("about:") == 1


def test_a_file_states_its_basis_consistently():
    base = yaml.safe_load((SHIPPED_SIM_PARAMS / f"{BASE}.yaml").read_text())
    for about, message in (({"basis": "fitted", "summary": "x"}, "fitted_to"),
                           ({"basis": "sourced", "summary": "x", "fitted_to": "a run"}, "fitted_to"),
                           ({"basis": "guessed", "summary": "x"}, "about.basis")):
        with pytest.raises(SimParamsError, match=message):
            SimParams.parse(base | {"about": about}, "f.yaml")
