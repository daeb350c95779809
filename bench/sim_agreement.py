"""The virtual clock against the real-time simulated cluster, on one spec and one load (issue 18
item 2): the load through the real actors, router and transfer (`pdc bench run`), then the same
load on the virtual clock, and the figures side by side (cluster/sim/virtual/agreement.py).

    .venv/bin/python -m pdcluster.bench.sim_agreement deploy/p8d8-sim.yaml --preset c90 \\
        --out .pdcluster/bench/agreement-c90

The cluster runs on free ports (another cluster may hold the spec's). Writes OUT/real (the
bench run), OUT/virtual (the virtual run, its timelines in OUT/virtual/timeline) and
OUT/agreement.json. Figures: bench/README.md "The virtual clock against the real-time sim".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from pdcluster.cluster.ports import on_free_ports
from pdcluster.cluster.replay.run import BenchConfig, run_bench
from pdcluster.cluster.sim.virtual.agreement import compare, format_agreement
from pdcluster.cluster.sim.virtual.run import simulate, write_virtual_run
from pdcluster.proto.spec import load_spec


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pdcluster.bench.sim_agreement", description=__doc__.split("\n")[0])
    ap.add_argument("spec")
    ap.add_argument("--preset", default="c90")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--out", default=f".pdcluster/bench/agreement-{time.strftime('%Y%m%d-%H%M%S')}")
    a = ap.parse_args(argv)
    import ray

    from pdcluster.cluster.launch import build_cluster, teardown
    from pdcluster.proto.names import NAMESPACE

    spec = on_free_ports(load_spec(a.spec))
    out = Path(a.out)
    overrides = {"num_requests": a.num_requests} if a.num_requests else {}
    ray.init(num_cpus=2, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    try:
        cluster = build_cluster(spec)
        try:
            t0 = time.monotonic()
            cfg = BenchConfig.from_preset(a.preset, base_url=cluster.url, out=str(out / "real"), **overrides)
            real = run_bench(cfg)
            real_wall = time.monotonic() - t0
        finally:
            teardown(cluster)
    finally:
        ray.shutdown()
    virtual = simulate(spec, dataclasses.replace(cfg, out=None), real.requests)
    write_virtual_run(virtual, out / "virtual")
    agreement = compare(real.summaries["formal"], virtual.summaries["formal"], [real.timelines[r.request_id] for r in real.results if r.request_id in real.timelines],
                        virtual.records)
    print(format_agreement(agreement))
    print(f"real-time: {real_wall:.1f} s for the load; virtual clock: {virtual.wall_s:.2f} s for "
          f"{virtual.virtual_s:.1f} s of it ({virtual.speedup:.0f}x)")
    (out / "agreement.json").write_text(json.dumps({
        "spec": a.spec, "preset": a.preset, "num_requests": a.num_requests, "real_wall_s": real_wall,
        "virtual_wall_s": virtual.wall_s, "virtual_s": virtual.virtual_s,
        "figures": [dataclasses.asdict(f) | {"rel_diff": f.rel_diff} for f in agreement.figures],
        "instances": [dataclasses.asdict(c) for c in agreement.instances]}, indent=1))


if __name__ == "__main__":
    main()
