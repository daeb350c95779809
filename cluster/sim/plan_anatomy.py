"""Where a planned configuration's time goes, and what binds it (issue 27 item 4): read from one
virtual-clock run, so `pdc plan` can say why a configuration misses or how close it runs.

- Busy, over the formal window (the first formal arrival to the last formal finish): P, the share
  of it an instance had a prefill in progress (p_scheduled..p_done; batched prefills overlap);
  D, its running requests (d_scheduled..finish) over its max_num_seqs slots. The mean over a
  role's instances, and the busiest.
- TTFT's parts: the mean over the formal requests served of each part of the critical path
  (router/attribution.py: queue for P, the prefill, the transfer not hidden under it, the wait
  for a D slot, the first decode step), as shares of the mean TTFT.
- Refused (429), preemptions (a running request put back for lack of KV blocks), evictions
  (cached blocks reused: prefixes no longer hittable).
- What binds, in this order: the router's cap when it refused requests; KV blocks when requests
  were preempted; else the largest wait in TTFT when it is WAIT_SHARE of it or more (P's queue:
  P; the wait for a slot: D; the transfer: the link); else a role busy past BUSY; else nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pdcluster.router.attribution import CRITICAL_PATH, attribute

BUSY = 0.85  # a role busier than this is saturated: its queue grows with any more load
WAIT_SHARE = 0.2  # a wait this large a share of TTFT names what is waited for
PART_NAMES = {"queue": "P's queue", "tier_load": "P's tier load", "prefill": "the prefill",
              "d_tier_load": "D's tier load", "transfer": "the transfer", "d_wait": "the wait for D",
              "first_decode": "D's first step", "migration": "migration", "local_prefill": "D's own prefill"}


@dataclass(frozen=True)
class Anatomy:
    p_busy: float  # mean share of the formal window P's instances had a prefill in progress
    d_busy: float  # mean share of D's running-request slots held over it
    p_busy_max: float
    d_busy_max: float
    ttft_mean_s: float | None  # over the formal requests served (None: none was)
    ttft_shares: dict[str, float]  # critical-path part -> its share of the mean TTFT
    refused: int  # formal requests refused (429) or failed
    preemptions: int
    evictions: int
    binds: str  # what limits the configuration, in words

    def line(self) -> str:
        shares = ", ".join(f"{PART_NAMES[k]} {v:.0%}" for k, v in self.ttft_shares.items() if v >= 0.005)
        return (f"P busy {self.p_busy:.0%} (max {self.p_busy_max:.0%}), D slots {self.d_busy:.0%} (max "
                f"{self.d_busy_max:.0%}); TTFT: {shares or 'not measured'}; {self.refused} refused, "
                f"{self.preemptions} preemptions, {self.evictions} evictions; binds: {self.binds}")


def _union_ns(spans: list[tuple[int, int]]) -> int:
    total, end = 0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            total, end = total + b - a, b
        elif b > end:
            total, end = total + b - end, b
    return total


def _busy(run, formal: set[str]) -> dict[str, list[float]]:
    """role -> each instance's busy share of the formal window (module docstring)."""
    ends = [(r.events["arrival"], r.events["finish"]) for r in run.records
            if r.request_id in formal and "arrival" in r.events and "finish" in r.events]
    if not ends:
        return {"prefill": [0.0], "decode": [0.0]}
    w0, w1 = min(a for a, _ in ends), max(b for _, b in ends)
    window = max(1, w1 - w0)
    clip = lambda a, b: (max(a, w0), min(b, w1))  # noqa: E731
    p_spans: dict[str, list] = {i.name: [] for i in run.instances if i.role == "prefill"}
    d_held: dict[str, int] = {i.name: 0 for i in run.instances if i.role == "decode"}
    for r in run.records:
        ev = r.events
        if r.prefill_instance in p_spans and "p_scheduled" in ev and "p_done" in ev:
            a, b = clip(ev["p_scheduled"], ev["p_done"])
            if b > a:
                p_spans[r.prefill_instance].append((a, b))
        if r.decode_instance in d_held and "d_scheduled" in ev and "finish" in ev:
            a, b = clip(ev["d_scheduled"], ev["finish"])
            d_held[r.decode_instance] += max(0, b - a)
    slots = run.spec.role_engine("decode").max_num_seqs
    return {"prefill": [_union_ns(s) / window for s in p_spans.values()] or [0.0],
            "decode": [held / window / slots for held in d_held.values()] or [0.0]}


def anatomy(run) -> Anatomy:
    """The anatomy of a VirtualRun (cluster/sim/virtual/run.py)."""
    formal_ids = {r.request_id for r in run.results if r.phase == "formal" and r.ok and r.request_id}
    busy = _busy(run, formal_ids)
    totals = dict.fromkeys(CRITICAL_PATH, 0)
    ttft_sum, n = 0, 0
    for rec in run.records:
        if rec.request_id not in formal_ids:
            continue
        a = attribute(rec)
        if a.ttft_ns is None:
            continue
        n += 1
        ttft_sum += a.ttft_ns
        for k, v in a.parts_ns.items():
            totals[k] += v
    shares = {k: v / ttft_sum for k, v in totals.items() if ttft_sum and v} if n else {}
    refused = sum(1 for r in run.results if r.phase == "formal" and not r.ok)
    preempted = sum(i.preemptions for i in run.instances)
    evicted = sum(i.evictions for i in run.instances)
    p, d = busy["prefill"], busy["decode"]
    a = Anatomy(sum(p) / len(p), sum(d) / len(d), max(p), max(d), ttft_sum / n / 1e9 if n else None, shares,
                refused, preempted, evicted, "")
    return dataclasses.replace(a, binds=_binds(a))


def _binds(a: Anatomy) -> str:
    if a.refused:
        return f"the router's cap: {a.refused} formal requests refused or failed"
    if a.preemptions:
        return f"KV blocks: {a.preemptions} running requests preempted"
    waits = {k: a.ttft_shares.get(k, 0.0) for k in ("queue", "d_wait", "transfer")}
    worst = max(waits, key=waits.get)
    if waits[worst] >= WAIT_SHARE:
        role = {"queue": f"P (busy {a.p_busy:.0%})", "d_wait": f"D (slots {a.d_busy:.0%} held)",
                "transfer": "the link"}[worst]
        return f"{role}: {PART_NAMES[worst]} is {waits[worst]:.0%} of TTFT"
    if a.p_busy >= BUSY:
        return f"P (busy {a.p_busy:.0%}): at the edge of queueing"
    if a.d_busy >= BUSY:
        return f"D (slots {a.d_busy:.0%} held): at the edge of queueing"
    own = a.ttft_shares.get("prefill", 0.0) + a.ttft_shares.get("local_prefill", 0.0)  # on P, or on D alone
    return f"nothing saturates: the prefill itself is {own:.0%} of TTFT"
