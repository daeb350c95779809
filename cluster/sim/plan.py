"""`pdc plan`: pick a P:D split and its settings for an SLO, on the virtual clock (issue 18 item 5).

Given a base cluster spec and a parameter file, a device budget (one device per instance), a
load and SLOs, every configuration tried is one `simulate` run of the whole load (the load is
built and its prompts hashed once for all of them). What is swept:
- the split: P from 1 to devices - 1, D the rest (by default every other P first, then the
  neighbours of the best of those: the whole range, one step apart, where it matters), and P0,
  no disaggregation: every device an instance that prefills and decodes its own requests
  (router.local_prefill always), the baseline each split is weighed against;
- the settings that matter, around the spec's own: the chunked-prefill budget
  (max_num_batched_tokens), the running requests per instance (max_num_seqs), the router's
  policy, a concurrency cap at the router (router.admission.max_in_flight: past it a
  request is refused with a 429, which counts against goodput), and conditional
  disaggregation (router.local_prefill: D prefills short remainders itself).
By default the settings are varied one at a time (each at half and twice the spec's value, each
other policy, caps at half and three quarters of the load's concurrency, D prefilling remainders
of at most 2,048 or 8,192 tokens) on the best split, so a 16-device C90 plan is 20 runs; `--splits`, `--budgets` etc. name values to cross instead.

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
from dataclasses import dataclass, field

from pdcluster.cluster.replay.metrics import per_request, percentile
from pdcluster.cluster.replay.run import BenchConfig, build_workload
from pdcluster.cluster.sim.plan_anatomy import Anatomy, anatomy
from pdcluster.cluster.sim.plan_provenance import Provenance, describe_load
from pdcluster.cluster.sim.virtual.prompts import PromptCache
from pdcluster.cluster.sim.virtual.run import VirtualRun, as_sim_spec, simulate
from pdcluster.cluster.sim.vocab import spec_vocab
from pdcluster.proto.router_spec import POLICIES, AdmissionSpec
from pdcluster.proto.spec import ClusterSpec

MISS = math.inf  # a refused or failed request's TTFT and TPOT: it missed any bound
# Bounds outside these are taken for a unit mistake (seconds given as ms, or the reverse), not an SLO.
PLAUSIBLE_TTFT_MS, PLAUSIBLE_TPOT_MS = (1.0, 600_000.0), (0.1, 2_000.0)


def pname(q: int) -> str:
    return f"p{q}"


@dataclass(frozen=True)
class Slo:
    ttft_s: float | None = None
    tpot_s: float | None = None
    percentile: int = 90  # 1..99: the bounds hold for this share of all requests sent
    min_throughput: float | None = None  # formal requests/s over the whole cluster

    def __post_init__(self):
        if not 1 <= self.percentile <= 99:
            raise ValueError(f"--slo-percentile {self.percentile}: a percentile from 1 to 99")
        if self.ttft_s is None and self.tpot_s is None and self.min_throughput is None:
            raise ValueError("no SLO: give --slo-ttft-ms, --slo-tpot-ms (or --goodput ttft:MS tpot:MS) "
                             "and/or --min-throughput")
        for name, v, (lo, hi) in (("TTFT", self.ttft_s, PLAUSIBLE_TTFT_MS), ("TPOT", self.tpot_s, PLAUSIBLE_TPOT_MS)):
            if v is not None and not lo <= v * 1e3 <= hi:
                ms = v * 1e3
                raise ValueError(f"a {name} bound of {f'{ms:,.0f}' if ms >= 100 else f'{ms:g}'} ms is implausible "
                                 f"({lo:g} to {hi:,.0f} ms): "
                                 f"the SLO flags take milliseconds (--slo-{name.lower()}-ms, --goodput "
                                 f"{name.lower()}:MS)")
        if self.min_throughput is not None and not self.min_throughput > 0:
            raise ValueError(f"--min-throughput {self.min_throughput:g}: requests per second, above 0")


@dataclass(frozen=True)
class Config:
    prefill: int
    decode: int
    max_num_batched_tokens: int
    max_num_seqs: int
    policy: str
    max_in_flight: int | None  # the router's admission cap; None: the spec's
    # Conditional disaggregation: D prefills a request itself when at most this many of its prompt
    # tokens are not in D's cache (router.local_prefill short_remainder); 0: never; None: the spec's.
    local_prefill: int | None = None

    @property
    def colocated(self) -> bool:
        """No P: every instance prefills and decodes (no disaggregation, the baseline)."""
        return self.prefill == 0

    @property
    def label(self) -> str:
        cap = f", cap {self.max_in_flight}" if self.max_in_flight else ""
        local = (", no disaggregation" if self.colocated else "" if self.local_prefill is None else
                 ", D never prefills" if self.local_prefill == 0 else f", D prefills <= {self.local_prefill}")
        return (f"P{self.prefill}D{self.decode}, budget {self.max_num_batched_tokens}, "
                f"seqs {self.max_num_seqs}, {self.policy}{cap}{local}")


@dataclass(frozen=True)
class Outcome:
    config: Config
    ttft_s: float | None  # at the SLO's percentile
    tpot_s: float | None
    e2e_mean_s: float | None
    throughput: float  # successful formal requests per second
    goodput_per_device: float  # formal requests meeting the latency SLO, per second, per device
    slo_met: bool
    failed: int  # formal requests refused (429) or failed
    hit_ratio: float | None
    virtual_s: float
    wall_s: float
    anatomy: Anatomy | None = None  # where its time goes, what binds it (plan_anatomy.py)

    @property
    def measured(self) -> bool:
        """Both percentiles known and on served requests (neither None nor MISS): a point to plot."""
        return self.ttft_s is not None and self.tpot_s is not None and MISS not in (self.ttft_s, self.tpot_s)


@dataclass
class Plan:
    slo: Slo
    devices: int
    workload: str
    outcomes: list[Outcome] = field(default_factory=list)  # ranked, best first
    provenance: Provenance | None = None  # None: a plan made by hand (tests)
    sim_base: ClusterSpec | None = None  # the base spec as simulated: each configuration is configure(sim_base, c)
    rerun_flags: list[str] = field(default_factory=list)  # the load's flags, for `pdc sim run` (plan_report)
    cfg: BenchConfig | None = None  # the load (plan_headroom scales it)
    vocab: int | None = None  # the prompts' vocabulary
    headrooms: dict = field(default_factory=dict)  # Config -> plan_headroom.Headroom, for those searched
    twin: Plan | None = None  # the same sweep on the parameter file's calibrated twin (Provenance.calibrated_twin)

    @property
    def chosen(self) -> Outcome:
        return self.outcomes[0]


def configure(base: ClusterSpec, c: Config) -> ClusterSpec:
    """The base spec with a configuration's split and settings."""
    engine = base.engine.model_copy(update={"max_num_batched_tokens": c.max_num_batched_tokens,
                                            "max_num_seqs": c.max_num_seqs})
    roles = {}
    for role, n in (("prefill", c.prefill), ("decode", c.decode)):
        r = getattr(base, role)
        own = r.engine.model_copy(update={"max_num_batched_tokens": None, "max_num_seqs": None})
        roles[role] = r.model_copy(update={"instances": n, "engine": own, "resources": r.resources.model_copy(
            update={"cpu_bind": None}), "placement": r.placement.model_copy(update={"per_instance": None})})
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
    return type(base).model_validate({**base.model_dump(), "engine": engine.model_dump(),
                                      **{k: v.model_dump() for k, v in roles.items()}, "router": router.model_dump()})


def base_config(base: ClusterSpec, devices: int, prefill: int) -> Config:
    eng = base.role_engine("prefill")
    return Config(prefill, devices - prefill, eng.max_num_batched_tokens, base.role_engine("decode").max_num_seqs,
                  base.router.policy, None)


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


def evaluate(run: VirtualRun, config: Config, slo: Slo, devices: int) -> Outcome:
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
    return Outcome(config, ttft, tpot, s.stats["E2EL"].avg, throughput, good / duration / devices, met,
                   s.total_requests - s.success_requests, s.measured_hit_ratio, run.virtual_s, run.wall_s,
                   anatomy(run))


def pareto(outcomes: list[Outcome]) -> list[Outcome]:
    """The configurations no other beats on both TTFT and TPOT, by TTFT."""
    pts = sorted((o for o in outcomes if o.measured), key=lambda o: (o.ttft_s, o.tpot_s))
    front, best_tpot = [], float("inf")
    for o in pts:
        if o.tpot_s < best_tpot:
            front.append(o)
            best_tpot = o.tpot_s
    return front


def rank(outcomes: Sequence[Outcome]) -> list[Outcome]:
    """Best first (module docstring): by the SLO, serving everyone, then goodput per device, where
    goodputs within TIE_REL of their group's best are equal (goodput_groups) and the lower TTFT
    goes first; equal keys keep the sweep's order."""
    groups = goodput_groups(outcomes)
    return sorted(outcomes, key=lambda o: (groups[id(o)], o.ttft_s if o.ttft_s is not None else float("inf")))


# Figures closer than this are equal: the virtual clock is exact, but a 1% difference is below what
# its cost model can tell (docs/sim.md "Validation against real engines").
TIE_REL = 0.01


def _verdict(o: Outcome) -> tuple[bool, bool]:
    return not o.slo_met, o.failed > 0


def goodput_groups(outcomes: Sequence[Outcome]) -> dict[int, int]:
    """id(outcome) -> its group, best first: the same verdicts (SLO met, everyone served) and a
    goodput per device within TIE_REL of the group's highest. A function of the set alone."""
    groups: dict[int, int] = {}
    top, g = None, -1
    for o in sorted(outcomes, key=lambda o: (_verdict(o), -o.goodput_per_device)):
        if top is None or _verdict(o) != _verdict(top) or not _close(o.goodput_per_device, top.goodput_per_device):
            top, g = o, g + 1
        groups[id(o)] = g
    return groups


def _close(a: float | None, b: float | None) -> bool:
    if a is None or b is None or MISS in (a, b):
        return a == b
    return abs(a - b) <= TIE_REL * max(abs(a), abs(b))


def tied(a: Outcome, b: Outcome) -> bool:
    """Nothing measured tells a and b apart: the same verdicts, and goodput, TTFT and TPOT within TIE_REL."""
    return (_verdict(a) == _verdict(b) and _close(a.goodput_per_device, b.goodput_per_device)
            and _close(a.ttft_s, b.ttft_s) and _close(a.tpot_s, b.tpot_s))


def decided_by(p: Plan) -> str:
    """What put the chosen configuration ahead of the next, in words (issue 27 item 5)."""
    if len(p.outcomes) < 2:
        return "the only configuration"
    a, b = p.outcomes[0], p.outcomes[1]
    q = pname(p.slo.percentile)
    if tied(a, b):
        n = sum(tied(a, o) for o in p.outcomes[1:])
        equal = a.ttft_s == b.ttft_s
        return (f"nothing: {n} other{'s' if n > 1 else ''} within {TIE_REL:.0%} on goodput, TTFT {q} and TPOT {q} "
                f"(marked = in the table); " + ("equal, the first swept was taken" if equal else
                                               f"first by a TTFT {q} lower by less than that ({a.ttft_s * 1e3:.6g} "
                                               f"against {b.ttft_s * 1e3:.6g} ms)"))
    if a.slo_met != b.slo_met:
        return "the SLO: the next misses it"
    if (a.failed > 0) != (b.failed > 0):
        return f"serving every request: the next refused or failed {b.failed}"
    groups = goodput_groups(p.outcomes)
    if groups[id(a)] != groups[id(b)]:
        return f"goodput per device: {a.goodput_per_device:.3f} against the next's {b.goodput_per_device:.3f} req/s"
    if not _close(a.ttft_s, b.ttft_s):
        return f"TTFT {q}, goodput within {TIE_REL:.0%}: {_ms(a.ttft_s)} against the next's {_ms(b.ttft_s)}"
    return (f"nothing the ranking reads (goodput and TTFT {q} within {TIE_REL:.0%}); TPOT {q} differs: "
            f"{_ms(a.tpot_s, 2)} against the next's {_ms(b.tpot_s, 2)}")


def _ms(v: float | None, digits: int = 0) -> str:
    return "none" if v is None else "a miss" if v == MISS else f"{v * 1e3:,.{digits}f} ms"


def plan(base: ClusterSpec, params: str | None, devices: int, cfg: BenchConfig, slo: Slo, workload: str,
         grid: dict[str, list] | None = None, on_run: Callable[[int, int, Outcome], None] | None = None, *,
         base_spec: str = "<spec>", note: str | None = None) -> Plan:
    """Sweep and rank. `grid`: explicit values ("splits" as P counts, "budgets", "max_seqs", "policies",
    "caps") crossed with each other; None: the default staged sweep (module docstring). `base_spec`:
    where `base` came from, for the provenance."""
    if devices < 2:
        raise ValueError(f"--devices {devices}: a P/D cluster needs at least 2 devices")
    sim_base = as_sim_spec(base, params)
    vocab, _ = spec_vocab(sim_base)
    requests = build_workload(cfg, cfg.vocab_size or vocab)
    prompts = PromptCache(sim_base.role_engine("prefill").block_size)
    result = Plan(slo, devices, workload,
                  provenance=Provenance.of(sim_base.sim.params, base_spec, describe_load(workload, cfg), note),
                  sim_base=sim_base, cfg=cfg, vocab=cfg.vocab_size or vocab)
    done: dict[Config, Outcome] = {}

    def run_all(configs: list[Config], total: int) -> None:
        for c in configs:
            if c in done:
                continue
            t0 = time.perf_counter()
            run = simulate(configure(sim_base, c), cfg, requests, prompts=prompts, vocab_size=vocab)
            out = dataclasses.replace(evaluate(run, c, slo, devices), wall_s=time.perf_counter() - t0)
            done[c] = out
            if on_run is not None:
                on_run(len(done), total, out)

    if grid:
        splits = grid.get("splits") or list(range(1, devices))
        for p in splits:
            if not 0 <= p < devices:
                raise ValueError(f"--splits: P{p} leaves no D of {devices} devices (P0: no disaggregation)")
        b = base_config(sim_base, devices, 1)
        configs = [Config(p, devices - p, budget, seqs, policy, cap, local)
                   for p, budget, seqs, policy, cap, local in
                   itertools.product(splits, grid.get("budgets") or [b.max_num_batched_tokens],
                                     grid.get("max_seqs") or [b.max_num_seqs], grid.get("policies") or [b.policy],
                                     grid.get("caps") or [None], grid.get("local_prefill") or [None])]
        run_all(configs, len(configs))
    else:
        coarse = list(range(1, devices, 2)) if devices > 4 else list(range(1, devices))
        # P0 first: the baseline with no disaggregation, on the same devices.
        splits = [base_config(sim_base, devices, p) for p in [0, *coarse]]
        total = len(splits) + (2 if devices > 4 else 0) + len(variations(splits[1], cfg.max_concurrency))
        run_all(splits, total)
        best = rank(list(done.values()))[0].config.prefill
        run_all([base_config(sim_base, devices, p) for p in (best - 1, best + 1) if 0 <= p < devices], total)
        best_config = rank(list(done.values()))[0].config
        run_all(variations(best_config, cfg.max_concurrency), total)
    result.outcomes = rank(list(done.values()))
    return result
