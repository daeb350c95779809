"""The same load through one cluster, once per pass of router settings, in one run.

Starts the spec's cluster on a local Ray, then replays the load (a preset or a trace) once per
pass, every prefix cache emptied between passes. A pass sets, on every router:
  local:off | local:N   router.local_prefill: every prefill on P, or D prefills remainders <= N
  pending:on | pending:off   router.track_pending (prefixes in flight)
joined with '+' (e.g. local:off+pending:off); a setting a pass leaves out stays as the spec says.
Per pass: the formal window's TTFT and TPOT (mean, p90), P's hit beside what the load could hit
at most, how many requests D served alone, and the interference the timelines measured (other
requests' ITL on a D during its local prefills vs without).

usage: python -m pdcluster.bench.router_passes SPEC --preset c90-tiny --passes local:off,local:1024
       python -m pdcluster.bench.router_passes deploy/p8d8-sim.yaml --trace T.jsonl --max-concurrency 90 \
           --passes pending:on,pending:off
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

from pdcluster.proto.router_spec import LocalPrefillSpec


@dataclass(frozen=True)
class Pass:
    name: str  # as given, e.g. "local:1024+pending:off"
    local: LocalPrefillSpec | None = None  # None: as the spec says
    track_pending: bool | None = None  # None: as the spec says

    @classmethod
    def parse(cls, text: str) -> Pass:
        local, pending = None, None
        for part in text.split("+"):
            key, _, value = part.partition(":")
            if key == "local" and value == "off":
                local = LocalPrefillSpec(policy="never")
            elif key == "local" and value.isdigit() and int(value) >= 1:
                local = LocalPrefillSpec(policy="short_remainder", max_tokens=int(value))
            elif key == "pending" and value in ("on", "off"):
                pending = value == "on"
            else:
                raise SystemExit(f"--passes: {part!r} is none of local:off, local:N, pending:on, pending:off")
        return cls(text, local, pending)

    def apply(self, cluster) -> None:
        if self.local is not None:
            cluster.each_router("set_local_prefill", self.local.model_dump())
        if self.track_pending is not None:
            cluster.each_router("set_track_pending", self.track_pending)


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
    expected_hit_ratio: float | None  # what the load could hit at most (its structure, failed requests out)
    exact_hits: int  # requests whose P hit the router predicted exactly
    local: int  # formal requests D prefilled itself
    itl_during_local_ms: float | None
    itl_without_local_ms: float | None


def run_pass(cluster, cfg, p: Pass) -> PassResult:
    import ray

    from pdcluster.cluster.replay.run import run_bench
    from pdcluster.router.local_views import local_summary

    p.apply(cluster)
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
        name=p.name, requests=formal.total_requests, failed=formal.failed_requests,
        ttft_mean_s=st["TTFT"].avg, ttft_p90_s=st["TTFT"].p90,
        tpot_mean_ms=st["TPOT"].avg * 1e3, tpot_p90_ms=st["TPOT"].p90 * 1e3,
        hit_ratio=formal.measured_hit_ratio, expected_hit_ratio=formal.expected_hit_ratio,
        exact_hits=sum(r.predicted_p_hit_tokens == r.p_cached_tokens for r in records
                       if r.predicted_p_hit_tokens is not None and not r.local_prefill),
        local=sum(r.local_prefill for r in records),
        itl_during_local_ms=local.itl_during_local.mean_ms if local and local.itl_during_local else None,
        itl_without_local_ms=local.itl_without_local.mean_ms if local and local.itl_without_local else None)


def table(results: list[PassResult]) -> str:
    f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    rows = ["| pass | requests (failed) | TTFT mean s | TTFT p90 s | TPOT mean ms | TPOT p90 ms | hit (max) | "
            "P hit predicted exactly | on D alone | ITL during / without local ms |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r.name} | {r.requests} ({r.failed}) | {r.ttft_mean_s:.3f} | {r.ttft_p90_s:.3f} | "
                    f"{r.tpot_mean_ms:.2f} | {r.tpot_p90_ms:.2f} | {f(r.hit_ratio and 100 * r.hit_ratio, '.1f')}% "
                    f"({f(r.expected_hit_ratio and 100 * r.expected_hit_ratio, '.1f')}%) | {r.exact_hits} | {r.local} | {f(r.itl_during_local_ms, '.2f')} / {f(r.itl_without_local_ms, '.2f')} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec")
    ap.add_argument("--preset", default=None)
    ap.add_argument("--trace", default=None, help="a Mooncake-format trace instead of a preset")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--passes", default="local:off,local:1024", help="comma-separated passes (see above)")
    ap.add_argument("--time-scale", type=float, default=1.0, help="trace: timestamps x this (0.5: twice the rate)")
    ap.add_argument("--num-requests", type=int, default=None, help="trace: its first N requests")
    ap.add_argument("--out", default=None, help="write the passes as JSON")
    a = ap.parse_args()
    passes = [Pass.parse(t) for t in a.passes.split(",")]

    import ray

    from pdcluster.cluster.launch import build_cluster, teardown
    from pdcluster.cluster.replay.run import BenchConfig
    from pdcluster.proto.names import NAMESPACE
    from pdcluster.proto.spec import load_spec

    spec = load_spec(a.spec)
    overrides = {"max_concurrency": a.max_concurrency} if a.max_concurrency else {}
    cfg = (BenchConfig.from_preset(a.preset, **overrides) if a.preset
           else BenchConfig(trace=a.trace, time_scale=a.time_scale, num_requests=a.num_requests, **overrides))
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
