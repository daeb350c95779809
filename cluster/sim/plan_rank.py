"""How `pdc plan` ranks its configurations, finds the Pareto front, tells ties and says what decided."""

from __future__ import annotations

from collections.abc import Sequence

from pdcluster.cluster.sim.plan_types import MISS, Outcome, Plan, pname


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
