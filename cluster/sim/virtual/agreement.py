"""How closely two runs of one spec and load agree: the virtual clock's against the real-time
sim's (issue 18 item 2), or a prediction against a real run (item 4).

Figures are the formal phase's, as cluster/replay/metrics.py computes them from each run's results
(the client's view: TTFT, TPOT, E2E mean and p90, the measured prefix-hit ratio), and the
requests each instance served (every phase, from the records), compared per role busiest
first: instances of a role are interchangeable, and the real router's choice between two equally
loaded ones can go either way (it counts a P's load when the call to it starts, a moment
after the pick), so one run's prefill-0 may be the other's prefill-1.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pdcluster.cluster.replay.metrics import PhaseSummary
from pdcluster.router.timeline import RequestRecord

METRICS: tuple[tuple[str, str, str], ...] = (  # (label, PhaseSummary stats metric, statistic)
    ("TTFT mean", "TTFT", "avg"), ("TTFT p90", "TTFT", "p90"),
    ("TPOT mean", "TPOT", "avg"), ("TPOT p90", "TPOT", "p90"),
    ("E2E mean", "E2EL", "avg"), ("E2E p90", "E2EL", "p90"),
)


@dataclass(frozen=True)
class Figure:
    label: str
    reference: float  # the run compared against (real-time sim, or the real engines)
    other: float  # the virtual clock's

    @property
    def rel_diff(self) -> float:
        return (self.other - self.reference) / self.reference if self.reference else float("inf")


@dataclass(frozen=True)
class InstanceCount:
    name: str  # "prefill #1": the role's busiest instance in each run
    reference: int
    other: int


@dataclass(frozen=True)
class Agreement:
    figures: list[Figure]
    instances: list[InstanceCount]

    def figure(self, label: str) -> Figure:
        return next(f for f in self.figures if f.label == label)

    def outside(self, tolerance: float, count_tolerance: int | None = None) -> list[str]:
        """What differs by more than `tolerance` (relative; the hit ratio: absolute) or, per
        instance, by more than `count_tolerance` requests (None: not checked)."""
        bad = [f"{f.label}: {f.other:.6g} vs {f.reference:.6g} ({f.rel_diff:+.1%})" for f in self.figures
               if f.label != "hit ratio" and abs(f.rel_diff) > tolerance]
        hit = self.figure("hit ratio")
        if abs(hit.other - hit.reference) > tolerance:
            bad.append(f"hit ratio: {hit.other:.4f} vs {hit.reference:.4f}")
        if count_tolerance is not None:
            bad += [f"{c.name}: {c.other} requests vs {c.reference}" for c in self.instances
                    if abs(c.other - c.reference) > count_tolerance]
        return bad


def served(records: Iterable[RequestRecord]) -> dict[str, int]:
    """Requests each instance served (P: prefills; D: decodes and its own prefills)."""
    out: dict[str, int] = {}
    for rec in records:
        for name in {rec.prefill_instance, rec.decode_instance} - {None}:
            out[name] = out.get(name, 0) + 1
    return out


def compare(reference: PhaseSummary, other: PhaseSummary, reference_records: Iterable[RequestRecord] = (),
            other_records: Iterable[RequestRecord] = ()) -> Agreement:
    figures = [Figure(label, getattr(reference.stats[m], stat), getattr(other.stats[m], stat))
               for label, m, stat in METRICS]
    figures.append(Figure("hit ratio", reference.measured_hit_ratio or 0.0, other.measured_hit_ratio or 0.0))
    ref, oth = served(reference_records), served(other_records)
    counts = []
    for role in ("prefill", "decode"):
        names = {n for n in [*ref, *oth] if n.startswith(role)}
        a = sorted((ref.get(n, 0) for n in names), reverse=True)
        b = sorted((oth.get(n, 0) for n in names), reverse=True)
        counts += [InstanceCount(f"{role} #{i + 1}", x, y) for i, (x, y) in enumerate(zip(a, b))]
    return Agreement(figures, counts)


def format_agreement(a: Agreement, reference: str = "real-time", other: str = "virtual") -> str:
    lines = [f"| | {reference} | {other} | difference |", "|---|---|---|---|"]
    for f in a.figures:
        if f.label == "hit ratio":
            lines.append(f"| hit ratio | {f.reference:.2%} | {f.other:.2%} | {f.other - f.reference:+.2%} |")
        else:
            lines.append(f"| {f.label} | {f.reference * 1e3:.1f} ms | {f.other * 1e3:.1f} ms | {f.rel_diff:+.1%} |")
    if a.instances:
        lines.append("")
        lines.append(f"requests per instance, busiest first ({reference} / {other}): "
                     + ", ".join(f"{c.name} {c.reference}/{c.other}" for c in a.instances))
    return "\n".join(lines)
