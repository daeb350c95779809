"""D prefilling short remainders (router.local_prefill) on and off, on one cluster, in one run.

Starts the spec's cluster on a local Ray, then replays the same load (a preset or a trace) once
per pass: `off` (every prefill on P), then `on:N` (short_remainder, max_tokens N) for each N
given; every prefix cache is emptied between passes. Per pass: the formal window's TTFT and TPOT
(mean, p90), the hit ratio, how many requests D served alone, and the interference the run's
timelines measured (other requests' ITL on a D during its local prefills vs without).

usage: python -m pdcluster.bench.local_prefill SPEC --preset c90-tiny [--passes off,on:1024]
       python -m pdcluster.bench.local_prefill deploy/p8d8-sim.yaml --preset c90 --passes off,on:1024,on:4096
       python -m pdcluster.bench.local_prefill deploy/p8d8-sim.yaml --trace T.jsonl --max-concurrency 90
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pass:
    name: str  # "off" | "on:1024"
    max_tokens: int | None  # None: off

    @classmethod
    def parse(cls, text: str) -> Pass:
        if text == "off":
            return cls(text, None)
        head, _, n = text.partition(":")
        if head != "on" or not n.isdigit() or int(n) < 1:
            raise SystemExit(f"--passes: 'off' or 'on:MAX_TOKENS' (e.g. on:1024), not {text!r}")
        return cls(text, int(n))

    def fields(self) -> dict:
        from pdcluster.router.local_prefill import LocalPrefillSpec

        if self.max_tokens is None:
            return LocalPrefillSpec(policy="never").model_dump()
        return LocalPrefillSpec(policy="short_remainder", max_tokens=self.max_tokens).model_dump()


@dataclass(frozen=True)
class PassResult:
    name: str
    requests: int
    failed: int
    ttft_mean_s: float
    ttft_p90_s: float
    tpot_mean_ms: float
    tpot_p90_ms: float
    hit_ratio: float | None
    local: int  # formal requests D prefilled itself
    itl_during_local_ms: float | None
    itl_without_local_ms: float | None


def run_pass(cluster, cfg, p: Pass) -> PassResult:
    import ray

    from pdcluster.bench.run import run_bench
    from pdcluster.router.local_views import local_summary

    cluster.each_router("set_local_prefill", p.fields())
    for inst in cluster.instances:
        deadline = time.monotonic() + 120  # a lease may pin blocks a moment longer
        while not ray.get(inst.actor.reset_prefix_cache.remote()):
            assert time.monotonic() < deadline, f"{inst.name} would not reset its prefix cache"
            time.sleep(0.2)
    run = run_bench(dataclasses.replace(cfg, out=None, progress=False), log=lambda *_: None)
    formal = run.summaries["formal"]
    ids = {r.request_id for r in run.results if r.phase == "formal"}
    records = [rec for rid, rec in run.timelines.items() if rid in ids]
    local = local_summary(records)
    st = formal.stats
    return PassResult(
        p.name, formal.total_requests, formal.failed_requests, st["TTFT"].avg, st["TTFT"].p90,
        st["TPOT"].avg * 1e3, st["TPOT"].p90 * 1e3, formal.measured_hit_ratio,
        sum(r.local_prefill for r in records),
        local.itl_during_local.mean_ms if local and local.itl_during_local else None,
        local.itl_without_local.mean_ms if local and local.itl_without_local else None)


def table(results: list[PassResult]) -> str:
    f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    rows = ["| pass | requests (failed) | TTFT mean s | TTFT p90 s | TPOT mean ms | TPOT p90 ms | P/D hit | "
            "on D alone | ITL during / without local ms |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r.name} | {r.requests} ({r.failed}) | {r.ttft_mean_s:.3f} | {r.ttft_p90_s:.3f} | "
                    f"{r.tpot_mean_ms:.2f} | {r.tpot_p90_ms:.2f} | {f(r.hit_ratio and 100 * r.hit_ratio, '.1f')}% | "
                    f"{r.local} | {f(r.itl_during_local_ms, '.2f')} / {f(r.itl_without_local_ms, '.2f')} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec")
    ap.add_argument("--preset", default=None)
    ap.add_argument("--trace", default=None, help="a Mooncake-format trace instead of a preset")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--passes", default="off,on:1024", help="comma-separated: off, on:MAX_TOKENS")
    ap.add_argument("--out", default=None, help="write the passes as JSON")
    a = ap.parse_args()
    passes = [Pass.parse(t) for t in a.passes.split(",")]

    import ray

    from pdcluster.bench.run import BenchConfig
    from pdcluster.cluster.launch import NAMESPACE, build_cluster, teardown
    from pdcluster.cluster.spec import load_spec

    spec = load_spec(a.spec)
    overrides = {"max_concurrency": a.max_concurrency} if a.max_concurrency else {}
    cfg = (BenchConfig.from_preset(a.preset, **overrides) if a.preset
           else BenchConfig(trace=a.trace, **overrides))
    ray.init(num_cpus=None if spec.ray_address else 2, include_dashboard=False, namespace=NAMESPACE,
             log_to_driver=False)
    cluster = build_cluster(spec)
    cfg = dataclasses.replace(cfg, base_url=cluster.url,
                              engine_block_size=spec.role_engine("prefill").block_size)
    results = []
    try:
        for p in passes:
            results.append(run_pass(cluster, cfg, p))
            print(table(results), "\n", flush=True)
    finally:
        teardown(cluster)
        ray.shutdown()
    if a.out:
        Path(a.out).write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=1))


if __name__ == "__main__":
    main()
