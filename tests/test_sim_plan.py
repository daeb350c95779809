"""`pdc plan` (cluster/sim/plan.py, plan_report.py, cluster/plan_cli.py) on a small load: the
ranking, the table, a self-contained HTML page that renders in headless Chromium with the chosen
configuration marked, the JSON, and a spec that validates as `pdc up` would read it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from chromium import chromium_page

from pdcluster.cluster.cli import main
from pdcluster.cluster.replay.run import BenchConfig
from pdcluster.cluster.sim.plan import all_requests_percentile
from pdcluster.cluster.sim.plan_rank import pareto, rank
from pdcluster.cluster.sim.plan_types import MISS, Config, Outcome, Slo
from pdcluster.proto.spec import load_spec

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
# C90's shape at a quarter of its length, fast enough that one P is not enough.
LOAD = ["--input-len", "32772", "--shared-prefix-ratio", str(29 * 1024 / 32772), "--output-len", "32",
        "--num-prefixes", "6", "--num-requests", "36", "--max-concurrency", "16", "--request-rate", "6"]


def outcome(prefill: int, ttft: float, tpot: float, goodput: float, met: bool, failed: int = 0) -> Outcome:
    return Outcome(Config(prefill, 8 - prefill, 8192, 16, "prefix_aware", None), ttft, tpot, ttft + 1, 1.0, goodput,
                   met, failed, 0.9, 10.0, 0.1)


def test_ranking_puts_the_slo_first_then_goodput_per_device():
    a, b, c = outcome(2, 3.0, 0.010, 0.9, False), outcome(4, 1.0, 0.012, 0.3, True), outcome(6, 0.8, 0.011, 0.5, True)
    assert rank([a, b, c]) == [c, b, a]
    assert pareto([a, b, c]) == [c, a]  # b is beaten on both by c


def test_a_configuration_that_sheds_load_never_outranks_one_that_serves_all():
    """Issue 27 item 3: P14:D2 ranked first while it refused 288 of 640 requests."""
    shedding = outcome(7, 0.5, 0.005, 0.9, True, failed=3)  # faster on what it served, more goodput
    serving_all = outcome(4, 1.4, 0.006, 0.6, True)
    missing = outcome(2, 0.4, 0.004, 1.0, False)
    assert rank([shedding, missing, serving_all]) == [serving_all, shedding, missing]


@pytest.mark.parametrize("values, q, want", [
    ([0.1, 0.2, 0.3, 0.4], 50, 0.25),  # no miss: the bench's linear percentile
    ([0.1, 0.2, 0.3, MISS], 50, 0.25),  # the rank stops short of the miss
    ([0.1, 0.2, MISS, MISS], 50, MISS),  # it reaches one: the percentile is a miss
    ([0.1] * 9 + [MISS], 90, MISS),  # 10% refused: p90 falls between a served one and a refused one
    ([0.1] * 10 + [MISS], 90, 0.1),  # 1 in 11: p90 lands on a served one (rank 9.0)
    ([MISS], 50, MISS),
    ([], 90, None),
])
def test_percentiles_are_over_every_request_a_refused_one_a_miss(values, q, want):
    assert all_requests_percentile(values, q) == pytest.approx(want) if want not in (MISS, None) else \
        all_requests_percentile(values, q) == want


def test_a_miss_reads_as_such_in_the_table_and_as_null_in_the_json():
    import math

    from pdcluster.cluster.sim.plan_report import format_table, to_json
    from pdcluster.cluster.sim.plan_types import Plan

    p = Plan(Slo(ttft_s=1.0, tpot_s=0.006), 8, "c90", [outcome(4, 1.4, 0.006, 0.6, True),
                                                       outcome(6, MISS, MISS, 0.1, False, failed=40)])
    assert "miss" in format_table(p).splitlines()[-1]
    second = json.loads(to_json(p))["configurations"][1]  # strict JSON: no Infinity
    assert second["ttft_s"] is None and second["tpot_s"] is None and second["failed"] == 40
    assert not math.isinf(json.loads(to_json(p))["configurations"][0]["ttft_s"])


def test_goodputs_within_1_percent_are_equal_and_the_lower_ttft_goes_first():
    """On a trace the first row had goodput 0.18021 and TTFT 2,459 ms, the second 0.18015 and
    2,376 ms: a goodput difference below what the model can tell decided, and was said to be TTFT."""
    from pdcluster.cluster.sim.plan_rank import decided_by
    from pdcluster.cluster.sim.plan_types import Plan

    slow, fast = outcome(4, 2.459, 0.0102, 0.18021, True), outcome(5, 2.376, 0.0105, 0.18015, True)
    ranked = rank([slow, fast])
    assert ranked == [fast, slow]
    assert decided_by(Plan(Slo(ttft_s=5.0, tpot_s=0.02), 16, "trace", ranked)).startswith(
        "TTFT p90, goodput within 1%: 2,376 ms against the next's 2,459 ms")
    far = outcome(6, 3.0, 0.0102, 0.25, True)  # 39% more goodput: first, whatever its TTFT
    assert rank([slow, fast, far])[0] is far


def test_equal_results_are_a_tie_and_the_plan_says_nothing_decided():
    """Issue 27 item 5: the C90 preset's first seven rows were equal to the last digit."""
    from pdcluster.cluster.sim.plan_rank import decided_by
    from pdcluster.cluster.sim.plan_report import format_table, to_json
    from pdcluster.cluster.sim.plan_types import Plan

    slo = Slo(ttft_s=2.0, tpot_s=0.006)
    first, same, within = outcome(8, 1.67, 0.0052, 0.345, True), outcome(8, 1.67, 0.0052, 0.345, True), \
        outcome(9, 1.675, 0.00521, 0.3435, True)
    other = outcome(10, 1.5, 0.0050, 0.30, True)
    p = Plan(slo, 16, "c90", rank([first, same, within, other]))
    assert p.outcomes[:3] == [first, same, within]  # equal keys keep the sweep's order
    assert decided_by(p).startswith("nothing: 2 others within 1% on goodput, TTFT p90 and TPOT p90")
    marks = [line.split()[1] for line in format_table(p).splitlines()[2:]]
    assert marks == ["8:0", "=", "=", "10:-2"]  # the tied rows marked, the chosen and the rest not
    assert json.loads(to_json(p))["tied_with_chosen"] == [same.config.label, within.config.label]


@pytest.mark.parametrize("second, says", [
    (outcome(6, 1.0, 0.005, 0.9, False), "the SLO: the next misses it"),
    (outcome(6, 1.0, 0.005, 0.9, True, failed=2), "serving every request: the next refused or failed 2"),
    (outcome(6, 1.0, 0.005, 0.3, True), "goodput per device: 0.345 against the next's 0.300 req/s"),
    (outcome(6, 1.9, 0.005, 0.344, True), "TTFT p90, goodput within 1%: 1,670 ms against the next's 1,900 ms"),
    (outcome(6, 1.671, 0.0060, 0.345, True), "TPOT p90 differs: 5.20 ms against the next's 6.00 ms"),
])
def test_the_plan_says_what_decided_between_the_first_two(second, says):
    from pdcluster.cluster.sim.plan_rank import decided_by
    from pdcluster.cluster.sim.plan_types import Plan

    p = Plan(Slo(ttft_s=2.0, tpot_s=0.006), 16, "c90", [outcome(8, 1.67, 0.0052, 0.345, True), second])
    assert says in decided_by(p)


def test_an_slo_needs_a_bound_a_percentile_from_1_to_99_and_plausible_values():
    with pytest.raises(ValueError, match="no SLO"):
        Slo()
    assert Slo(ttft_s=1.0, percentile=95).percentile == 95 and Slo(tpot_s=0.006, percentile=1).percentile == 1
    for q in (0, 100):
        with pytest.raises(ValueError, match=f"--slo-percentile {q}: a percentile from 1 to 99"):
            Slo(ttft_s=1.0, percentile=q)
    with pytest.raises(ValueError, match="TTFT bound of 2,000,000 ms is implausible"):
        Slo(ttft_s=2000.0)  # 2000 meant as ms, given as seconds
    with pytest.raises(ValueError, match="TPOT bound of 0.006 ms is implausible"):
        Slo(tpot_s=0.006e-3)  # 0.006 meant as seconds, given as ms
    with pytest.raises(ValueError, match="--min-throughput"):
        Slo(min_throughput=0.0)


def plan_args(tmp_path, *slo: str, params: str = "dsv4-flash-910c") -> list[str]:
    return ["plan", params, "--devices", "4", *LOAD, "--out", str(tmp_path), "--splits", "2", "--headroom", "none",
            *slo]


@pytest.mark.parametrize("slo", [["--slo-ttft-ms", "1500", "--slo-tpot-ms", "6"], ["--goodput", "ttft:1500", "tpot:6"],
                                 ["--slo-ttft-ms", "1500", "--goodput", "tpot:6"]])
def test_slo_bounds_are_milliseconds_as_vllms_goodput_takes_them(tmp_path, slo, capsys):
    main(plan_args(tmp_path, *slo, "--slo-percentile", "95"))
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert doc["slo"] == {"ttft_s": 1.5, "tpot_s": 0.006, "percentile": 95, "min_throughput": None}
    out = capsys.readouterr().out
    assert "SLO TTFT p95 <= 1,500 ms, TPOT p95 <= 6.0 ms" in out and "TTFT p95 ms" in out


@pytest.mark.parametrize("slo, message", [
    (["--slo-ttft-p90", "2.0"], "--slo-ttft-p90 (seconds) is gone: the bound is in milliseconds, --slo-ttft-ms"),
    (["--slo-tpot", "0.006"], "--slo-tpot-p90 (seconds) is gone"),
    (["--slo-ttft-ms", "2000000"], "a TTFT bound of 2,000,000 ms is implausible"),
    (["--slo-tpot-ms", "6000"], "a TPOT bound of 6,000 ms is implausible"),
    (["--goodput", "ttft:2000", "e2el:9000"], "--goodput 'e2el:9000': KEY:MS with KEY one of ttft, tpot"),
    (["--goodput", "ttft=2000"], "--goodput 'ttft=2000': KEY:MS"),
    (["--goodput", "ttft:fast"], "'fast' is not a number of milliseconds"),
    (["--slo-ttft-ms", "2000", "--goodput", "ttft:3000"], "the TTFT bound is given twice"),
    (["--slo-ttft-ms", "2000", "--slo-percentile", "100"], "--slo-percentile 100: a percentile from 1 to 99"),
])
def test_slo_mistakes_are_refused_naming_the_flag(tmp_path, slo, message, capsys):
    with pytest.raises(SystemExit) as err:
        main(plan_args(tmp_path, *slo))
    assert err.value.code == 2 and message in capsys.readouterr().err


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> Path:
    """The plan's directory, and what it printed in stdout.txt there."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("plan")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(["plan", "dsv4-flash-910c", "--devices", "6", "--spec", str(DEPLOY / "p8d8-sim.yaml"), *LOAD,
              "--slo-ttft-ms", "1500", "--slo-tpot-ms", "6", "--out", str(out), "--write-spec",
              str(out / "chosen.yaml")])
    (out / "stdout.txt").write_text(printed.getvalue())
    return out


def test_every_output_names_the_model_its_basis_the_base_spec_and_the_load(planned):
    """Issue 27 item 1: the terminal, plan.html, plan.json and the written spec."""
    want = ["model: dsv4-flash-910c (cluster/sim/params/dsv4-flash-910c.yaml), sourced",
            "unchecked: Never run against real engines with this model on this chip",
            "steps vary: not at all (no spread measured for this file)",
            "base spec: deploy/p8d8-sim.yaml (the default)",
            "load: synthetic: 32,772-token prompts, 91% shared over 6 prefixes, 32 output tokens; at most 16 in "
            "flight, 6 req/s, 36 requests, seed 0"]
    import html

    outputs = {"terminal": (planned / "stdout.txt").read_text(),
               "plan.html": html.unescape((planned / "plan.html").read_text()),
               "chosen.yaml": (planned / "chosen.yaml").read_text()}
    for name, text in outputs.items():
        flat = " ".join(text.replace("# ", " ").split())
        missing = [w for w in want if w not in flat]
        assert not missing, (name, missing)
    prov = json.loads((planned / "plan.json").read_text())["provenance"]
    assert (prov["params"], prov["basis"], prov["fitted_to"]) == ("dsv4-flash-910c", "sourced", None)
    assert prov["base_spec"] == want[3].removeprefix("base spec: ") and prov["workload"] == want[4].removeprefix("load: ")
    assert prov["steps_vary"].startswith(want[2])
    assert prov["error"]["ttft"] == [-0.9, -0.9] and prov["calibrated_twin"] == "dsv4-flash-910c-seed002"


def test_a_fitted_file_is_named_with_what_it_was_fitted_to(tmp_path, capsys):
    main(plan_args(tmp_path, "--slo-ttft-ms", "1500", params="dsv4-flash-910c-seed002"))
    out = capsys.readouterr().out
    assert ("model: dsv4-flash-910c-seed002 (cluster/sim/params/dsv4-flash-910c-seed002.yaml), fitted to seed "
            "002's C90 on P8+D8 (TTFT 12.68 s, TPOT 10.3 ms, E2E 23.24 s)") in out


def test_the_plan_writes_its_table_json_and_a_spec_that_validates(planned, capsys):
    doc = json.loads((planned / "plan.json").read_text())
    configs = doc["configurations"]
    splits = {c["config"]["prefill"] for c in configs}
    best = doc["chosen"]["config"]["prefill"]
    # No disaggregation (P0) and every other P, then the best's neighbours.
    assert splits == {0, 1, 3, 5} | {p for p in (best - 1, best + 1) if 0 <= p < 6}
    assert all(c["config"]["prefill"] + c["config"]["decode"] == 6 for c in configs)
    assert doc["chosen"] == configs[0]
    for a, b in zip(configs, configs[1:]):  # by verdict, then goodput (1% apart counts as equal), then TTFT
        va, vb = (not a["slo_met"], a["failed"] > 0), (not b["slo_met"], b["failed"] > 0)
        assert va < vb or (va == vb and b["goodput_per_device"] <= a["goodput_per_device"] * 1.01 + 1e-12), (a, b)
    spec = load_spec(planned / "chosen.yaml")  # as pdc up reads it
    # The load is light: no disaggregation ranks first, and the spec written is the best split.
    assert doc["chosen"]["config"]["prefill"] == 0
    chosen = next(c for c in configs if c["config"]["prefill"] > 0)["config"]
    assert "note: the best is no disaggregation" in (planned / "stdout.txt").read_text()
    assert (spec.prefill.instances, spec.decode.instances) == (chosen["prefill"], chosen["decode"])
    assert spec.role_engine("prefill").max_num_batched_tokens == chosen["max_num_batched_tokens"]
    assert spec.router.policy == chosen["policy"] and spec.sim.params.endswith("dsv4-flash-910c.yaml")
    assert (planned / "chosen.yaml").read_text().startswith("# Written by pdc plan")


def test_the_html_is_self_contained_and_renders_with_the_chosen_one_marked(planned):
    page_html = (planned / "plan.html").read_text()
    assert not re.search(r"https?://", page_html) and "<script" not in page_html
    doc = json.loads((planned / "plan.json").read_text())
    n = len(doc["configurations"])
    with chromium_page(planned / "plan.html") as (page, errors):
        assert page.title().startswith("pdc plan")
        # The answer first: right under the title, what to run and why, before the table and the plot.
        order = page.evaluate("[...document.body.children].map(e => e.id || e.tagName)")
        assert order[:2] == ["H1", "answer"] and order.index("configurations") < order.index("pareto"), order
        chosen = doc["chosen"]["label"]
        assert page.locator("#chosen-text").inner_text().startswith(
            f"Run {chosen}: it meets the SLO" if doc["chosen"]["slo_met"] else "No configuration meets the SLO")
        assert doc["decided_by"] in page.locator("#answer").inner_text()
        assert "binds: " in page.locator("#anatomy").inner_text()  # where its time goes
        h = doc["chosen"]["headroom"]
        assert h["runs"] > 1 and f"up to {h['load']}" in page.locator("#headroom").inner_text()
        assert page.locator("#pareto circle.point").count() == n
        assert page.locator("#pareto #chosen").count() == 1
        assert page.locator("#configurations tbody tr").count() == n
        # Every point says which configuration it is when hovered.
        titles = page.locator("#pareto circle.point title").evaluate_all("els => els.map(e => e.textContent)")
        assert sorted(t.split(": TTFT")[0].split(" ", 1)[1] for t in titles) == sorted(c["label"] for c in
                                                                                        doc["configurations"])
        box = page.locator("#pareto").bounding_box()
        assert box is not None and box["width"] > 500
    assert errors == []


def test_the_front_is_drawn_among_the_configurations_that_met_the_slo():
    from pdcluster.cluster.sim.plan_report import _svg
    from pdcluster.cluster.sim.plan_types import Plan

    met_fast, met_slow = outcome(4, 1.0, 0.005, 0.6, True), outcome(5, 1.5, 0.004, 0.5, True)
    missed = outcome(6, 0.5, 0.003, 0.7, False)  # beats both: the front over every point would start there
    svg = _svg(Plan(Slo(ttft_s=2.0, tpot_s=0.006), 8, "c90", [met_fast, met_slow, missed]))
    points = re.search(r'<polyline points="([^"]+)" class="front"/>', svg).group(1).split()
    circles = dict(re.findall(r'<circle cx="([\d.]+)" cy="([\d.]+)" r="5" class="point met"', svg))
    assert len(points) == 2 and all(p.split(",")[0] in circles for p in points), (points, circles)
    assert "log scale" in svg


def test_each_configuration_is_re_run_with_the_command_beside_it(planned, tmp_path):
    """The command in the page's row (configs/NN.yaml and the plan's load) reproduces its figures,
    with timelines `pdc timeline report` opens."""
    import shlex

    from pdcluster.router.run_store import load_run

    doc = json.loads((planned / "plan.json").read_text())
    cells = re.findall(r'<td class="cmd"><details><summary>command</summary><code>([^<]+)</code></details></td>',
                       (planned / "plan.html").read_text())
    assert len(cells) == len(doc["configurations"]) and all(c.startswith("pdc sim run ") for c in cells)
    argv = shlex.split(html_unescape(cells[1]))[1:]  # the second configuration's
    main(argv)
    out = Path(argv[argv.index("--out") + 1])
    formal = json.loads((out / "summary.json").read_text())["phases"]["formal"]
    assert formal["stats"]["E2EL"]["avg"] == pytest.approx(doc["configurations"][1]["e2e_mean_s"], rel=1e-9)
    assert len([r for r in load_run(out / "timeline").records if "formal" in r.request_id]) == 36


def html_unescape(text: str) -> str:
    import html

    return html.unescape(text)


def test_bad_arguments_name_the_flag(tmp_path, capsys):
    for args, message in ((["--slo-ttft-ms", "1000", "--splits", "4,3"], "--splits: P4 leaves no D"),
                          (["--slo-ttft-ms", "1000", "--policies", "fastest"], "unknown policy 'fastest'"),
                          (["--slo-ttft-ms", "1000", "--budgets", "lots"], "--budgets 'lots'"),
                          ([], "no SLO")):
        with pytest.raises(SystemExit) as err:
            main(["plan", "dsv4-flash-910c", "--devices", "4", *LOAD, "--out", str(tmp_path), *args])
        assert err.value.code == 2 and message in capsys.readouterr().err, message


def test_the_load_is_the_benchs(planned):
    # The plan's load is pdc bench run's, from the same arguments (BenchConfig).
    cfg = BenchConfig(input_len=32772, num_prefixes=6, num_requests=36)
    assert cfg.seed_phase and json.loads((planned / "plan.json").read_text())["workload"] == "synthetic"


def test_a_spec_written_for_a_target_is_the_target_with_only_the_chosen_fields(tmp_path):
    """Issue 27 item 6: planned on deploy/p8d8-npu.yaml's simulated twin (its checkpoint is not
    here: the parameter file's model, the tiny model's token ids), written as that NPU spec."""
    import yaml

    target = DEPLOY / "p8d8-npu.yaml"
    out = tmp_path / "plan"
    main(["plan", "dsv4-flash-910c", "--devices", "4", *LOAD, "--splits", "1,3", "--slo-ttft-ms", "1500",
          "--target", str(target), "--out", str(out), "--write-spec", str(tmp_path / "npu.yaml")])
    chosen = json.loads((out / "plan.json").read_text())["chosen"]["config"]
    want = yaml.safe_load(target.read_text())
    want["prefill"]["instances"], want["decode"]["instances"] = chosen["prefill"], chosen["decode"]
    want["engine"] |= {"max_num_batched_tokens": chosen["max_num_batched_tokens"], "max_num_seqs": chosen["max_num_seqs"]}
    want["router"]["policy"] = chosen["policy"]
    text = (tmp_path / "npu.yaml").read_text()
    assert yaml.safe_load(text) == want  # the target, but for the chosen fields
    spec = load_spec(tmp_path / "npu.yaml")  # as pdc up reads it
    assert spec.device == "npu" and spec.role_engine("prefill").kind == "vllm"
    assert spec.model.path == "/models/DeepSeek-V4-Flash" and (spec.prefill.instances, spec.decode.instances) == (
        chosen["prefill"], chosen["decode"])
    for here in (str(DEPLOY.parent), str(tmp_path), str(Path.home())):  # no path of this machine
        assert here not in text, here
    assert "# base spec: deploy/p8d8-npu.yaml (the target)" in text
    assert "# note: the target's checkpoint (/models/DeepSeek-V4-Flash) is not here" in text


def test_the_calibrated_twin_answers_beside_the_named_file(planned):
    """Issue 27 item 2: dsv4-flash-910c names its twin fitted to seed 002's measured C90; the plan
    runs the same sweep on it and shows both answers, each with its error band."""
    doc = json.loads((planned / "plan.json").read_text())
    twin = json.loads((planned / "twin" / "plan.json").read_text())
    assert doc["twin"]["params"] == twin["provenance"]["params"] == "dsv4-flash-910c-seed002"
    assert doc["twin"]["chosen"]["label"] == twin["chosen"]["label"]
    coarse = {(1, 5), (3, 3), (5, 1)}  # the same sweep: every other split, then around its own best
    for d in (doc, twin):
        assert coarse <= {(c["config"]["prefill"], c["config"]["decode"]) for c in d["configurations"]}
    printed = (planned / "stdout.txt").read_text()
    assert "Side by side, the same sweep on the calibrated twin dsv4-flash-910c-seed002, fitted to seed 002's C90" \
        in printed
    with chromium_page(planned / "plan.html") as (page, errors):
        text = page.locator("#answer #twin").inner_text()
        assert "calibrated twin dsv4-flash-910c-seed002" in text and "Error band:" in text
        assert page.locator("#band").inner_text().startswith("Error band: if it errs as when checked: real TTFT p90")
    assert errors == []


def test_no_twin_skips_it(tmp_path):
    main(plan_args(tmp_path, "--slo-ttft-ms", "1500", "--no-twin"))
    assert json.loads((tmp_path / "plan.json").read_text())["twin"] is None and not (tmp_path / "twin").exists()


def test_the_error_band_is_where_the_real_figure_falls_if_the_model_errs_as_when_checked():
    from pdcluster.cluster.sim.plan_provenance import Provenance
    from pdcluster.cluster.sim.plan_report import band_text, real_band
    from pdcluster.cluster.sim.plan_types import Plan
    from pdcluster.cluster.sim.sim_params import ErrorBand

    band = ErrorBand(source="a check", ttft=(-0.5, 0.25), tpot=(0.0, 0.0), e2e=(-0.1, 0.1))
    assert band.real_range("ttft", 1.0) == (0.8, 2.0)  # predicted 50% low: real twice; 25% high: real 0.8x
    prov = Provenance("p", "p.yaml", "fitted", "s", "a run", "spec", "load", error=band)
    o = outcome(4, 1.0, 0.006, 0.5, True)
    p = Plan(Slo(ttft_s=2.0, tpot_s=0.01), 8, "c90", [o], provenance=prov)
    assert real_band(p, o) == {"ttft_s": (0.8, 2.0), "tpot_s": (0.006, 0.006)}
    assert band_text(p, o) == ("if it errs as when checked: real TTFT p90 800-2,000 ms, TPOT p90 6.0 ms "
                               "(the check's band is on means)")
    never = Plan(p.slo, 8, "c90", [o], provenance=dataclasses_replace(prov, error=None))
    assert real_band(never, o) is None and band_text(never, o).startswith("no error band: this model was never")
    with pytest.raises(ValueError, match=r"ttft: \[lowest, highest\]"):
        ErrorBand(source="x", ttft=(0.2, -0.2), tpot=(0, 0), e2e=(0, 0))


def dataclasses_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)
