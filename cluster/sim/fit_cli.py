"""`pdc sim fit RUN_DIR --params BASE --out NEW.yaml`: fit BASE's free numbers to a run's timelines
(cluster/sim/fit.py), measure how the run's steps vary around it (cluster/sim/fit_variation.py)
and write the fitted file; prints each number and the residuals before and after."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _fail(message: str) -> None:
    print(f"pdc sim fit: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _cmd_fit(a: argparse.Namespace) -> None:
    from pdcluster.cluster.sim.cost import CostModel, SimParams, SimParamsError
    from pdcluster.cluster.sim.fit import FREE, FitError, FittedNumber, fit, observations, run_spec
    from pdcluster.cluster.sim.fit_output import fitted_yaml, residual_summary
    from pdcluster.cluster.sim.fit_variation import MIN_GAPS, measure
    from pdcluster.proto.spec import SpecError, resolve_sim_params
    from pdcluster.router.run_store import load_run

    free = tuple(a.free.split(",")) if a.free else FREE
    try:
        run = load_run(a.run)
        base_path = Path(resolve_sim_params(a.params, str))
        base = SimParams.load(base_path)
        block_size = run_spec(run).role_engine("prefill").block_size
        obs = observations(run, CostModel(base, block_size))
        result = fit(base, block_size, obs, free)
        variation = None if a.no_variation else measure(run, result.params)
    except (OSError, ValueError, SpecError, SimParamsError, FitError) as err:
        _fail(str(err))
    out = Path(a.out)
    name = a.name or out.stem
    numbers = list(result.numbers)
    if variation is not None:
        determined = variation.decode_gaps >= MIN_GAPS
        numbers += [FittedNumber(k, float(getattr(base.variation, k.split(".")[1])), v, determined)
                    for k, v in variation.numbers().items()]
    out.parent.mkdir(parents=True, exist_ok=True)  # --out DIR/x.yaml: DIR made, as any --out
    out.write_text(fitted_yaml(base_path.read_text(), numbers, name, f"run {run.meta.run_id} ({a.run})"))
    print(f"fitted {base.name} to run {run.meta.run_id}: {len(obs.prefill_s)} prefills that ran alone "
          f"(of {obs.prefill_requests}), {len(obs.decode_of)} D steps in {len(obs.decode_s)} spans "
          f"(of {obs.decode_gaps} seen); "
          f"{result.dropped} outliers dropped")
    print(f"{'number':<30} {'base':>10} {'fitted':>10}")
    for n in result.numbers:
        note = "" if n.determined else "  (the run does not determine it: kept)"
        print(f"{n.name:<30} {n.base:>10.4g} {n.value:>10.4g}{note}")
    base_p, base_d = result.base_residuals
    print(f"prefill residuals: base {residual_summary(base_p)}; fitted {residual_summary(result.prefill_residuals)}")
    print(f"decode residuals:  base {residual_summary(base_d)}; fitted {residual_summary(result.decode_residuals)}")
    if variation is not None:
        v = variation
        print(f"variation around the fitted model (log spread): D steps {v.decode_sd:.3f} each + {v.drift_sd:.3f} "
              f"shared over {v.drift_steps} steps ({v.decode_gaps} steps); prefill steps {v.prefill_sd:.3f} "
              f"({v.prefills} prefills)" + ("" if v.decode_gaps >= MIN_GAPS else f": under {MIN_GAPS} steps, kept"))
    print(f"wrote {out} (name {name})")


def add_fit_command(sub) -> None:
    f = sub.add_parser("fit", help="fit a parameter file's efficiencies and overheads to a run's timelines")
    f.add_argument("run", help="a run directory (meta.json, requests.jsonl): real engines or simulated")
    f.add_argument("--params", required=True, help="the base parameter file (a shipped name or a path)")
    f.add_argument("--out", required=True, help="where to write the fitted parameter file")
    f.add_argument("--name", help="the fitted file's name: field (default: the --out file's stem)")
    f.add_argument("--free", help="comma-separated numbers to fit (default: every efficiency and overhead)")
    f.add_argument("--no-variation", action="store_true",
                   help="keep the base file's step-time variation (default: measure it around the fitted model)")
    f.set_defaults(fn=_cmd_fit)
