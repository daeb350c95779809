"""How much more load a planned configuration takes before it misses the SLO (issue 27 item 4):
the highest load at which it still meets it, found by search on the virtual clock.

The load is the plan's (its requests, prefixes, concurrency cap) at a scaled arrival rate: a
synthetic load's request rate times m, a trace's arrivals m times as fast (time_scale / m), a
closed loop's concurrency cap times m. A load "holds" at m when the SLO is met over every request
sent and, for an open load, the cluster keeps up: the requests in flight never reach the load's
concurrency cap (there the bench client holds arrivals back before sending them, a wait no TTFT
counts, as vLLM's bench and AISBench do). Holding is taken to be monotonic in m: doubling (or halving) brackets the edge,
bisection narrows it to `precision`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from pdcluster.cluster.replay.run import BenchConfig, build_workload
from pdcluster.cluster.sim.plan import configure, evaluate
from pdcluster.cluster.sim.plan_types import MISS, Outcome, Plan, Slo, pname
from pdcluster.cluster.sim.virtual.run import simulate

MAX_FACTOR = 64.0


@dataclass(frozen=True)
class Headroom:
    factor: float | None  # the highest load factor found to hold (None: not even 1/MAX_FACTOR of the load)
    load: str  # that load in words ("8.4 req/s", "1.5x the trace's arrivals", "at most 12 in flight")
    throughput: float | None  # completed formal requests per second there
    concurrency: float | None  # mean requests in flight there
    beyond: str  # why the next load tried did not hold: the SLO, keeping up, and what binds
    runs: int


def _kind(cfg: BenchConfig) -> str:
    """What scales the load: a trace's pace, a synthetic load's rate, or a closed loop's cap."""
    return "trace" if cfg.trace and not cfg.closed_loop else "rate" if cfg.request_rate and not cfg.trace else "closed"


def scaled(cfg: BenchConfig, m: float) -> BenchConfig:
    kind = _kind(cfg)
    if kind == "trace":
        return dataclasses.replace(cfg, time_scale=cfg.time_scale / m)
    if kind == "rate":
        return dataclasses.replace(cfg, request_rate=cfg.request_rate * m)
    return dataclasses.replace(cfg, max_concurrency=max(1, round(cfg.max_concurrency * m)))


def describe(cfg: BenchConfig, m: float) -> str:
    kind, s = _kind(cfg), scaled(cfg, m)
    if kind == "trace":
        return f"{m:.2f}x the trace's arrivals"
    if kind == "rate":
        return f"{s.request_rate:.2f} req/s"
    return f"at most {s.max_concurrency} in flight"


def headroom(p: Plan, outcome: Outcome, precision: float = 0.05,
             on_run: Callable[[float, bool], None] | None = None) -> Headroom:
    """The search (module docstring) for one configuration of plan `p` (made by plan.plan)."""
    assert p.sim_base is not None and p.cfg is not None and p.vocab, "a plan made by plan.plan"
    spec, cfg, vocab = configure(p.sim_base, outcome.config), p.cfg, p.vocab
    open_load = _kind(cfg) != "closed"
    tried: dict[float, tuple[bool, Outcome, float | None]] = {}  # m -> (holds, outcome, mean in flight)

    def holds(m: float) -> bool:
        if m not in tried:
            c = scaled(cfg, m)
            requests = build_workload(c, c.vocab_size or vocab)
            run = simulate(spec, c, requests, vocab_size=vocab)
            o = evaluate(run, outcome.config, p.slo)
            ok = o.slo_met and (not open_load or c.max_concurrency is None
                                or _peak_in_flight(run.results) < c.max_concurrency)
            tried[m] = (ok, o, run.summaries["formal"].concurrency)
            if on_run is not None:
                on_run(m, ok)
        return tried[m][0]

    if holds(1.0):
        lo, hi = 1.0, 2.0
        while hi <= MAX_FACTOR and holds(hi):
            lo, hi = hi, hi * 2
        if hi > MAX_FACTOR:
            return _found(cfg, lo, tried, f"it held up to {MAX_FACTOR:g}x the load, where the search stops")
    else:
        lo, hi = 0.5, 1.0
        while lo >= 1 / MAX_FACTOR and not holds(lo):
            lo, hi = lo / 2, lo
        if lo < 1 / MAX_FACTOR:
            return Headroom(None, "none", None, None, _why(tried[hi][1], cfg, hi, p.slo), len(tried))
    while hi / lo > 1 + precision:
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if holds(mid) else (lo, mid)
    return _found(cfg, lo, tried, _why(tried[hi][1], cfg, hi, p.slo))


def _peak_in_flight(results) -> int:
    """The most requests in flight at once (sent, not yet answered)."""
    edges = sorted([(r.start_s, 1) for r in results] + [(r.end_s, -1) for r in results], key=lambda e: (e[0], e[1]))
    peak = n = 0
    for _, d in edges:
        n += d
        peak = max(peak, n)
    return peak


def _found(cfg: BenchConfig, m: float, tried: dict, beyond: str) -> Headroom:
    _, o, in_flight = tried[m]
    return Headroom(m, describe(cfg, m), o.throughput, in_flight, beyond, len(tried))


def _why(o: Outcome, cfg: BenchConfig, m: float, slo: Slo) -> str:
    if o.slo_met:
        return (f"at {describe(cfg, m)} all {cfg.max_concurrency} of the load's requests in flight are taken: "
                f"arrivals wait in the client (more in flight than the load allows)")
    q, missed = pname(slo.percentile), []
    for name, got, bound in (("TTFT", o.ttft_s, slo.ttft_s), ("TPOT", o.tpot_s, slo.tpot_s)):
        if bound is not None and (got is None or got > bound):
            missed.append(f"{name} {q} {'a miss' if got in (None, MISS) else f'{got * 1e3:,.1f} ms'} > "
                          f"{bound * 1e3:,.1f} ms")
    if slo.min_throughput is not None and o.throughput < slo.min_throughput:
        missed.append(f"{o.throughput:.2f} req/s < {slo.min_throughput:g}")
    return (f"at {describe(cfg, m)} it misses the SLO ({', '.join(missed) or 'no request served'})"
            + (f"; binds: {o.anatomy.binds}" if o.anatomy else ""))

def text(h: Headroom, cfg: BenchConfig) -> str:
    """The headroom in a sentence."""
    if h.factor is None:
        return f"it misses the SLO at every load tried, down to 1/{MAX_FACTOR:g} of this one; {h.beyond}"
    times = "" if h.load.endswith("arrivals") else f"{h.factor:.2f}x this load; "
    return (f"it meets the SLO up to {h.load} ({times}{h.throughput:.2f} req/s completed, "
            f"{h.concurrency:.1f} in flight on average); {h.beyond}")
