"""`pdc sim ...`: the simulated cluster on the virtual clock (cluster/sim/virtual/, docs/sim.md).

  pdc sim run SPEC [--params P] [--preset c90 | synthetic | --trace F] [--out DIR]
      the load on the spec's cluster in one process, no Ray, no sleeping; prints what
      `pdc bench run` and `pdc timeline summary` print, and writes both
  pdc sim fit RUN_DIR --params BASE --out NEW.yaml
      fit BASE's free numbers to a run's timelines (cluster/sim/fit.py)

A bad spec, parameter file or argument is one line on stderr naming it, and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _fail(message: str) -> None:
    print(f"pdc sim: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _cmd_run(a: argparse.Namespace) -> None:
    from pdcluster.cluster.replay.bench_cli import config_from_args
    from pdcluster.cluster.replay.outputs import format_phase_breakdown
    from pdcluster.cluster.sim.cost import SimParamsError
    from pdcluster.cluster.sim.virtual.run import simulate, write_virtual_run
    from pdcluster.proto.spec import SpecError, load_spec
    from pdcluster.router.run_store import load_run
    from pdcluster.router.timeline_views import format_summary, summarize

    try:
        spec = load_spec(a.spec)
        cfg = config_from_args(a, progress=False)
        t0 = time.perf_counter()
        run = simulate(spec, cfg, params=a.params, repeat_steps=a.repeat_steps,
                       on_phase=lambda phase, n: print(f"phase {phase}: {n} requests", file=sys.stderr))
    except (SpecError, SimParamsError, ValueError, OSError) as err:
        _fail(str(err))
    total = time.perf_counter() - t0
    out = Path(a.out or f".pdcluster/sim/{spec.name}-{cfg.preset or 'load'}-{time.strftime('%Y%m%d-%H%M%S')}")
    write_virtual_run(run, out)
    from pdcluster.cluster.replay.outputs import format_summary as format_bench

    main = run.summaries.get("formal") or next(reversed(run.summaries.values()))
    print(format_bench(main))
    if run.hit_mismatches:
        print(f"cache check: {len(run.hit_mismatches)} mismatches:\n  " + "\n  ".join(run.hit_mismatches[:10]))
    formal_ids = {r.request_id for r in run.results if r.phase == "formal"}
    print(format_phase_breakdown(r for r in run.records if r.request_id in formal_ids))
    print(format_summary(summarize(load_run(out / "timeline"))))
    print(f"virtual clock: {run.virtual_s:.1f} s of load in {run.wall_s:.2f} s ({run.speedup:.0f}x; "
          f"{total:.2f} s with the load built), {run.events} events")
    print(f"written to {out}/ (bench files) and {out}/timeline (pdc timeline summary|report {out}/timeline)")


def add_sim_commands(subparsers) -> None:
    from pdcluster.cluster.replay.bench_cli import add_load_arguments

    sim = subparsers.add_parser("sim", help="the simulated cluster on a virtual clock: run a load, fit parameters")
    sub = sim.add_subparsers(dest="sim_cmd", required=True)
    r = sub.add_parser("run", help="run a load on a spec's cluster on the virtual clock (one process, no Ray)")
    r.add_argument("spec", help="cluster spec (engine: sim, or a vLLM spec with --params)")
    r.add_argument("--params", help="cost-model parameter file (a shipped name or a path): replaces the spec's")
    add_load_arguments(r)
    r.add_argument("--out", help="output directory (default .pdcluster/sim/<spec>-<preset>-<time>)")
    r.add_argument("--no-repeat", dest="repeat_steps", action="store_false",
                   help="run every decode step as its own event (slower; the same outcome)")
    r.set_defaults(fn=_cmd_run)
    from pdcluster.cluster.sim.fit_cli import add_fit_command

    add_fit_command(sub)
