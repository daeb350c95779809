"""The host KV tier at the users' scale, on the virtual clock (issue 29): simulated P8+D8 under a
C90-shaped load of 64 prefix families, for DeepSeek-V4-Flash on 910C and a dense Qwen3-8B-like
model on H200, in five modes: no tier; the host tier; the tier with D prefilling short remainders
itself (router.local_prefill, `--local-max-tokens`) but reading no P's tier; and that with the pool
(D reads a family a P's tier holds and computes the rest); the tier with P reading a peer P's tier
(router.p_pool: `tier+ppool`).

- `dsv4`: deploy/p8d8-sim-tiered.yaml as shipped (device caches sized so that each P's ~8 families
  are 3.1x its cache and D's 64 are 3.6x its own; 64 GiB of tier a card), the C90 preset with 64
  families.
- `qwen3-8b`: the same spec with qwen3-8b-h200's parameters and the caches one H200 really has
  (5,510 blocks: 5.4 contexts of 131K; each P's ~8 families are 1.35x it), D running at most 5
  requests (what its memory holds), `--dense-tier-gib` of tier a GPU (a DGX H200's 2 TB of host
  memory is 256 GB a GPU; at 18.9 MB a block the tier must hold a P's ~7,400 blocks), at
  `--dense-rate` requests a second (one H200 per instance serves far fewer than C90's 6 a second:
  its cold prefill of a 128K prompt takes ~23 s).

Per case: the formal phase's delivered hit beside the structural maximum (every block an
unlimited cache would hold), TTFT mean and p90, how much of P's hit came from its tier, and how
many requests D prefilled itself, reading the pool.

usage: python -m pdcluster.bench.kv_tier_sim [--cases dsv4,qwen3-8b] [--modes off,tier,tier+local,tier+pool,tier+ppool]
                                             [--num-requests 640] [--families 64] [--dense-rate 0.8] [--dense-tier-gib 200]
                                             [--local-max-tokens 16384] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from pdcluster.cluster.replay.run import BenchConfig
from pdcluster.cluster.sim.virtual.run import simulate
from pdcluster.proto.router_spec import LocalPrefillSpec
from pdcluster.proto.spec import load_spec
from pdcluster.proto.spec_sections import RoleKvBlocks

TIERED = Path(__file__).resolve().parents[1] / "deploy" / "p8d8-sim-tiered.yaml"
FAMILIES = 64
MODES = ("off", "tier", "tier+local", "tier+pool", "tier+ppool")


@dataclass(frozen=True)
class Outcome:
    case: str
    mode: str  # MODES
    structural_hit: float  # the formal phase's expected hit (an unlimited cache's)
    delivered_hit: float
    p_tier_share: float  # of P's hit tokens, those its tier served
    ttft_mean_s: float
    ttft_p90_s: float
    local: int  # formal requests D prefilled itself
    pooled: int  # formal requests whose prefiller (D, or P) read a P's tier
    requests: int
    failed: int
    wall_s: float


def with_tier(spec, on: bool):
    """The spec as it is, or with no tier anywhere (a role's unset field inherits the engine's)."""
    if on:
        return spec
    off = {"host_tier_gib": None}
    return spec.model_copy(update={"engine": spec.engine.model_copy(update=off), **{
        role: getattr(spec, role).model_copy(update={"engine": getattr(spec, role).engine.model_copy(update=off)})
        for role in ("prefill", "decode")}})


def in_mode(spec, mode: str, local_max_tokens: int):
    """The spec in one of MODES."""
    spec = with_tier(spec, mode != "off")
    if mode in ("tier+local", "tier+pool"):
        local = LocalPrefillSpec(policy="short_remainder", max_tokens=local_max_tokens, pool=mode == "tier+pool")
        spec = spec.model_copy(update={"router": spec.router.model_copy(update={"local_prefill": local})})
    if mode == "tier+ppool":
        spec = spec.model_copy(update={"router": spec.router.model_copy(update={"p_pool": True})})
    return spec


def dense(spec, tier_gib: float):
    """The tiered spec on qwen3-8b-h200: the caches an H200 holds, D at what its memory runs."""
    d_engine = spec.decode.engine.model_copy(update={"max_num_seqs": 5})
    return spec.model_copy(update={
        "engine": spec.engine.model_copy(update={"host_tier_gib": tier_gib}),
        "decode": spec.decode.model_copy(update={"engine": d_engine}),
        "sim": spec.sim.model_copy(update={"params": str(Path(__file__).resolve().parents[1] / "cluster" / "sim" /
                                                         "params" / "qwen3-8b-h200.yaml"),
                                           "kv_blocks": RoleKvBlocks()}),
})


def measure(case: str, spec, cfg: BenchConfig, mode: str, local_max_tokens: int = 16384) -> Outcome:
    run = simulate(in_mode(spec, mode, local_max_tokens), cfg)
    formal = run.summaries["formal"]
    records = [r for r in run.records if "-formal-" in r.request_id]
    cached = sum(r.p_cached_tokens for r in records)
    return Outcome(case, mode, formal.expected_hit_ratio, formal.measured_hit_ratio,
                   sum(r.p_tier_tokens for r in records) / cached if cached else 0.0,
                   formal.stats["TTFT"].avg, formal.stats["TTFT"].p90, sum(r.local_prefill for r in records),
                   sum(r.pool_tokens > 0 for r in records), formal.total_requests, formal.failed_requests, run.wall_s)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="dsv4,qwen3-8b")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--local-max-tokens", type=int, default=16384,
                    help="router.local_prefill.max_tokens in the tier+local and tier+pool modes")
    ap.add_argument("--num-requests", type=int, default=640, help="formal requests (C90: 640)")
    ap.add_argument("--families", type=int, default=FAMILIES, help="prefix families (C90: 16)")
    ap.add_argument("--dense-rate", type=float, default=0.8, help="qwen3-8b: requests a second")
    ap.add_argument("--dense-tier-gib", type=float, default=200, help="qwen3-8b: host tier per GPU, GiB")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    base = load_spec(TIERED)
    cases = {"dsv4": (base, BenchConfig.from_preset("c90", num_prefixes=a.families, num_requests=a.num_requests)),
             "qwen3-8b": (dense(base, a.dense_tier_gib), BenchConfig.from_preset("c90", num_prefixes=a.families,
                                                               num_requests=a.num_requests, request_rate=a.dense_rate))}
    out = []
    modes = a.modes.split(",")
    if bad := [m for m in modes if m not in MODES]:
        ap.error(f"--modes: {', '.join(bad)} not among {', '.join(MODES)}")
    print(f"{'case':10} {'mode':10} {'structural':>10} {'delivered':>9} {'P from tier':>11} {'TTFT mean':>10} "
          f"{'TTFT p90':>9} {'D alone':>7} {'pooled':>6} {'failed':>6}")
    for name in a.cases.split(","):
        spec, cfg = cases[name]
        for mode in modes:
            o = measure(name, spec, cfg, mode, a.local_max_tokens)
            out.append(o)
            print(f"{o.case:10} {o.mode:10} {o.structural_hit:10.1%} {o.delivered_hit:9.1%} {o.p_tier_share:11.1%} "
                  f"{o.ttft_mean_s:9.2f}s {o.ttft_p90_s:8.2f}s {o.local:7} {o.pooled:6} {o.failed:6}", flush=True)
    if a.out:
        a.out.write_text(json.dumps([asdict(o) for o in out], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
