"""`pdc plan`: pick a P:D split and its settings for an SLO, on the virtual clock (issue 18 item 5).

Given a base cluster spec and a parameter file, a device budget (one device per instance, or as
many as `--devices-per-instance` says: tensor parallel degrees the parameter file prices), a
load and SLOs, every configuration tried is one `simulate` run of the whole load (the load is
built and its prompts hashed once for all of them). What is swept:
- the split: P from 1 to instances - 1, D the rest (by default every other P first, then the
  neighbours of the best of those: the whole range, one step apart, where it matters), and P0,
  no disaggregation: every device an instance that prefills and decodes its own requests
  (router.local_prefill always), the baseline each split is weighed against;
- the settings that matter, around the spec's own: the chunked-prefill budget
  (max_num_batched_tokens), the running requests per instance (max_num_seqs), the router's
  policy, a concurrency cap at the router (router.admission.max_in_flight: past it a
  request is refused with a 429, which counts against goodput), and conditional
  disaggregation (router.local_prefill: D prefills short remainders itself);
- with `tier_gib` sizes (`--tier-gib`), each instance's host KV tier: on the best configuration
  of the staged sweep, or crossed with the grid's values (plan_report says what each size buys).
By default the settings are varied one at a time (each at half and twice the spec's value, each
other policy, caps at half and three quarters of the load's concurrency, D prefilling remainders
of at most 2,048 or 8,192 tokens) on the best split of all degrees, so a 16-device C90 plan is 20 runs; `--splits`, `--budgets` etc. name values to cross instead.

Every request sent counts (issue 27 item 3): the SLO's percentiles are over all formal requests,
a refused (429) or failed one a miss (an infinite TTFT and TPOT), so a configuration that sheds
more than the percentile allows misses the SLO however fast it served the rest.

Ranking (`rank`): first whether the SLO holds (TTFT and TPOT at the SLO's percentile, and the
request throughput if one is asked for), then whether every request was served (one that sheds
load never outranks one that serves all), then goodput per device (formal requests that met
both latency targets, per second of the formal window, per device), then the TTFT percentile.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Sequence

from pdcluster.cluster.replay.metrics import per_request, percentile
from pdcluster.cluster.replay.run import BenchConfig, build_workload
from pdcluster.cluster.sim.plan_anatomy import anatomy
from pdcluster.cluster.sim.plan_provenance import Provenance, describe_load
from pdcluster.cluster.sim.plan_rank import rank
from pdcluster.cluster.sim.plan_types import MISS, Config, Outcome, Plan, Slo
from pdcluster.cluster.sim.sim_params import SimParams
from pdcluster.cluster.sim.virtual.prompts import PromptCache
from pdcluster.cluster.sim.virtual.run import VirtualRun, as_sim_spec, simulate
from pdcluster.cluster.sim.vocab import spec_vocab
from pdcluster.proto.router_spec import POLICIES, AdmissionSpec
from pdcluster.proto.spec import ClusterSpec


def configure(base: ClusterSpec, c: Config) -> ClusterSpec:
    """The base spec with a configuration's split and settings. Devices per instance: the simulated
    engine's `sim.devices_per_instance`; for real engines vLLM's tensor_parallel_size and as many
    GPUs or NPUs per instance (left as they are at one device)."""
    settings = {"max_num_batched_tokens": c.max_num_batched_tokens, "max_num_seqs": c.max_num_seqs}
    if c.host_tier_gib is not None:
        settings["host_tier_gib"] = c.host_tier_gib or None
    engine = base.engine.model_copy(update=settings)
    roles = {}
    for role, n in (("prefill", c.prefill), ("decode", c.decode)):
        r = getattr(base, role)
        own = r.engine.model_copy(update=dict.fromkeys(settings))  # (unset: the engine's, as configured)
        resources = {"cpu_bind": None}
        if c.devices_per_instance > 1:
            own = own.model_copy(update={"extra": {**own.extra, "tensor_parallel_size": c.devices_per_instance}})
            resources |= {k: c.devices_per_instance for k in ("gpus", "npus") if getattr(r.resources, k)}
        roles[role] = r.model_copy(update={"instances": n, "engine": own, "resources": r.resources.model_copy(
            update=resources), "placement": r.placement.model_copy(update={"per_instance": None})})
    admission = base.router.admission
    if c.max_in_flight is not None:
        admission = AdmissionSpec(**{**admission.model_dump(), "max_in_flight": c.max_in_flight})
    local = base.router.local_prefill
    if c.colocated:
        local = local.model_copy(update={"policy": "always"})
    elif c.local_prefill == 0:
        local = local.model_copy(update={"policy": "never"})
    elif c.local_prefill is not None:
        local = local.model_copy(update={"policy": "short_remainder", "max_tokens": c.local_prefill})
    router = base.router.model_copy(update={"policy": c.policy, "admission": admission, "local_prefill": local})
    sim = {} if base.sim is None else {"sim": base.sim.model_copy(
        update={"devices_per_instance": c.devices_per_instance}).model_dump()}
    return type(base).model_validate({**base.model_dump(), "engine": engine.model_dump(),
                                      **{k: v.model_dump() for k, v in roles.items()}, "router": router.model_dump(),
                                      **sim})


def base_config(base: ClusterSpec, instances: int, prefill: int, devices_per_instance: int = 1) -> Config:
    eng = base.role_engine("prefill")
    return Config(prefill, instances - prefill, eng.max_num_batched_tokens, base.role_engine("decode").max_num_seqs,
                  base.router.policy, None, devices_per_instance=devices_per_instance)


LOCAL_PREFILL_TOKENS = (2048, 8192)  # the default sweep's conditional disaggregation thresholds


def variations(around: Config, load_concurrency: int | None) -> list[Config]:
    """One setting at a time, around a configuration (module docstring); no caps for a load
    without one (a trace on its timestamps)."""
    out = [dataclasses.replace(around, max_num_batched_tokens=b)
           for b in (around.max_num_batched_tokens // 2, around.max_num_batched_tokens * 2)]
    out += [dataclasses.replace(around, max_num_seqs=s) for s in (max(1, around.max_num_seqs // 2),
                                                                  around.max_num_seqs * 2)]
    out += [dataclasses.replace(around, policy=p) for p in POLICIES if p != around.policy]
    caps = sorted({max(1, load_concurrency // 2), max(1, load_concurrency * 3 // 4)}) if load_concurrency else []
    out += [dataclasses.replace(around, max_in_flight=cap) for cap in caps]
    if not around.colocated:  # with no P, D prefills everything already
        out += [dataclasses.replace(around, local_prefill=n) for n in LOCAL_PREFILL_TOKENS]
    return out


def all_requests_percentile(values: Sequence[float], q: float) -> float | None:
    """The linear percentile (as the bench's, cluster/replay/metrics.py) over every request, misses
    as MISS: infinite once the rank reaches them. None: no values."""
    v = sorted(values)
    if not v:
        return None
    h = (len(v) - 1) * q / 100
    lo = math.floor(h)
    hi = min(lo + 1, len(v) - 1)
    if v[hi] == MISS:  # on the first miss's rank or past it: a miss; exactly on the last served: it
        return MISS if h > lo or v[lo] == MISS else v[lo]
    return percentile(v, q)


def evaluate(run: VirtualRun, config: Config, slo: Slo) -> Outcome:
    s = run.summaries["formal"]
    ttfts, tpots, good = [], [], 0
    for r in run.results:
        if r.phase != "formal":
            continue
        m = per_request(r) if r.ok and r.chunk_s else None
        if m is None:  # refused, failed or nothing streamed: a miss on both
            ttfts.append(MISS)
            tpots.append(MISS)
            continue
        ttfts.append(m.ttft_s)
        if m.tpot_s is not None:  # one output token has no TPOT
            tpots.append(m.tpot_s)
        good += ((slo.ttft_s is None or m.ttft_s <= slo.ttft_s)
                 and (slo.tpot_s is None or m.tpot_s is None or m.tpot_s <= slo.tpot_s))
    ttft = all_requests_percentile(ttfts, slo.percentile)
    tpot = all_requests_percentile(tpots, slo.percentile)
    duration = s.benchmark_duration_s or float("inf")
    throughput = s.request_throughput_per_s or 0.0
    met = (s.success_requests > 0 and (slo.ttft_s is None or (ttft is not None and ttft <= slo.ttft_s))
           and (slo.tpot_s is None or (tpot is not None and tpot <= slo.tpot_s))
           and (slo.min_throughput is None or throughput >= slo.min_throughput))
    return Outcome(config, ttft, tpot, s.stats["E2EL"].avg, throughput, good / duration / config.devices, met,
                   s.total_requests - s.success_requests, s.measured_hit_ratio, run.virtual_s, run.wall_s,
                   anatomy(run))


def plan(base: ClusterSpec, params: str | None, devices: int, cfg: BenchConfig, slo: Slo, workload: str,
         grid: dict[str, list] | None = None, on_run: Callable[[int, int, Outcome], None] | None = None, *,
         base_spec: str = "<spec>", note: str | None = None, degrees: Sequence[int] = (1,)) -> Plan:
    """Sweep and rank. `grid`: explicit values ("splits" as P counts, "budgets", "max_seqs", "policies",
    "caps", "tier_gib") crossed with each other; None, or only "tier_gib": the default staged sweep
    (module docstring), then each host tier size on its best configuration. `base_spec`:
    where `base` came from, for the provenance. `degrees`: devices per instance to try, each one
    the parameter file prices (its `parallel` section) and `devices` divides into two instances or more."""
    if devices < 2:
        raise ValueError(f"--devices {devices}: a P/D cluster needs at least 2 devices")
    degrees = sorted(set(degrees))
    if not degrees:
        raise ValueError("--devices-per-instance: one or more degrees, e.g. 1,2,4")
    sim_base = as_sim_spec(base, params)
    priced = SimParams.load(sim_base.sim.params)
    for t in degrees:
        priced.check_degree(t)
        if devices % t or devices // t < 2:
            raise ValueError(f"--devices-per-instance {t}: {devices} devices make no whole number of instances "
                             f"of {t} devices, two or more")
    vocab, _ = spec_vocab(sim_base)
    requests = build_workload(cfg, cfg.vocab_size or vocab)
    prompts = PromptCache(sim_base.role_engine("prefill").block_size)
    result = Plan(slo, devices, workload,
                  provenance=Provenance.of(sim_base.sim.params, base_spec, describe_load(workload, cfg), note),
                  sim_base=sim_base, cfg=cfg, vocab=cfg.vocab_size or vocab)
    done: dict[Config, Outcome] = {}
    grid = dict(grid or {})
    tiers = grid.pop("tier_gib", None)
    if tiers and any(g < 0 for g in tiers):
        raise ValueError(f"--tier-gib {','.join(map(str, tiers))}: sizes in GiB, 0 (no tier) or more")

    def run_all(configs: list[Config], total: int) -> None:
        for c in configs:
            if c in done:
                continue
            t0 = time.perf_counter()
            run = simulate(configure(sim_base, c), cfg, requests, prompts=prompts, vocab_size=vocab)
            out = dataclasses.replace(evaluate(run, c, slo), wall_s=time.perf_counter() - t0)
            done[c] = out
            if on_run is not None:
                on_run(len(done), total, out)

    if grid:
        b = base_config(sim_base, devices, 1)
        configs = []
        for t in degrees:
            n = devices // t
            splits = grid.get("splits") or list(range(1, n))
            for p in splits:
                if not 0 <= p < n:
                    raise ValueError(f"--splits: P{p} leaves no D of {n} instances of {t} device{'s' * (t > 1)} "
                                     f"(P0: no disaggregation)")
            configs += [Config(p, n - p, budget, seqs, policy, cap, local, t, tier)
                        for p, budget, seqs, policy, cap, local, tier in
                        itertools.product(splits, grid.get("budgets") or [b.max_num_batched_tokens],
                                          grid.get("max_seqs") or [b.max_num_seqs], grid.get("policies") or [b.policy],
                                          grid.get("caps") or [None], grid.get("local_prefill") or [None],
                                          tiers or [None])]
        run_all(configs, len(configs))
    else:
        # Per degree: P0 first (the baseline with no disaggregation, on the same devices), every other
        # split, then the neighbours of that degree's best; then the settings around the best of all.
        firsts = {}
        for t in degrees:
            n = devices // t
            coarse = list(range(1, n, 2)) if n > 4 else list(range(1, n))
            firsts[t] = [base_config(sim_base, n, p, t) for p in [0, *coarse]]
        total = (sum(len(f) + (2 if devices // t > 4 else 0) for t, f in firsts.items())
                 + len(variations(firsts[degrees[0]][1], cfg.max_concurrency)) + len(tiers or ()))
        for t, splits in firsts.items():
            run_all(splits, total)
            n = devices // t
            best = rank([o for c, o in done.items() if c.devices_per_instance == t])[0].config.prefill
            run_all([base_config(sim_base, n, p, t) for p in (best - 1, best + 1) if 0 <= p < n], total)
        best_config = rank(list(done.values()))[0].config
        run_all(variations(best_config, cfg.max_concurrency), total)
        if tiers:  # what a host tier buys the best configuration, at each size
            best_config = rank(list(done.values()))[0].config
            run_all([dataclasses.replace(best_config, host_tier_gib=g) for g in tiers], total)
    result.outcomes = rank(list(done.values()))
    return result
