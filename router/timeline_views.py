"""Terminal views of a run: a summary table of where TTFT goes, and one request's waterfall.

Everything is computed from the recorded router-clock events through
`attribution` (so the numbers here, the Perfetto export and the HTML report
agree), and printed in milliseconds.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pdcluster.router.attribution import (
    CRITICAL_PATH,
    INTERVALS,
    OPTIONAL_PARTS,
    Attribution,
    attribute,
    critical_path,
    intervals,
)
from pdcluster.router.local_views import LocalSummary, format_local, local_summary
from pdcluster.router.run_store import Run
from pdcluster.router.timeline import EVENT_ORDER, RequestRecord
from pdcluster.router.timeline_stats import NS_PER_MS, Ratios, Stats, percentile  # noqa: F401  (re-exported)


@dataclass(frozen=True)
class Failure:
    request_id: str
    stopped_after: str | None  # the last event reached (None: no event at all)
    error: str | None


@dataclass(frozen=True)
class FailureKind:
    stopped_after: str | None
    kind: str  # the error's head (before the first ':'), with the request id taken out
    count: int


@dataclass
class Summary:
    run_id: str
    total: int
    completed: int  # reached first_token without an error
    failed: int  # an error, or never reached first_token
    phases: dict[str, Stats]  # CRITICAL_PATH names + "ttft" -> over the requests that have that part
    shares: dict[str, float]  # CRITICAL_PATH name -> sum(part) / sum(ttft), over complete requests
    attributed: int  # how many complete requests the shares are over
    intervals: dict[str, Stats]  # INTERVALS names (they overlap) -> over the requests that have them
    itl: Stats | None  # gaps between consecutive output tokens, pooled over requests
    tpot: Stats | None  # per request: (last_token - first_token) / (output_tokens - 1)
    prompt_tokens: int
    p_cached_tokens: int
    d_cached_tokens: int
    transferred_tokens: int
    p_tier_tokens: int  # of p_cached_tokens, those P loaded from its host KV tier
    d_tier_tokens: int  # of d_cached_tokens, those D loaded from its host KV tier
    pool_tokens: int  # of transferred_tokens, those D read from a P's host tier (the pool)
    bytes_per_group: dict[str, int]  # KV-cache group's label (GroupTransfer.label) -> bytes pulled, summed over requests
    recomputed: int  # requests whose KV pull failed and D recomputed the prompt
    # Requests moved off a lost instance (router/migration.py), and the moves, per lost role.
    migrated: int = 0
    migrations: dict[str, int] = field(default_factory=dict)
    unfinished: int = 0  # came in, no record: their router stopped first (Run.unfinished)
    # KV transfer time under P's prefill vs on the critical path, summed over requests
    # that recorded both (push mode hides the first; pull mode has none).
    transfer_hidden_ns: int = 0
    transfer_exposed_ns: int = 0
    failures: list[Failure] = field(default_factory=list)
    failure_kinds: list[FailureKind] = field(default_factory=list)
    policies: tuple[str, ...] = ()  # routing policies the requests were picked by
    predictions: dict[str, HitPrediction] = field(default_factory=dict)  # "P" / "D"
    requests_per_instance: dict[str, int] = field(default_factory=dict)
    slowest: list[tuple[str, int]] = field(default_factory=list)  # (request id, TTFT ns), the slowest first
    # Per request, P's prefill time as predicted / as P's engine took it (p_scheduled to p_done).
    prefill_time_ratio: Ratios | None = None
    local: LocalSummary | None = None  # router/local_views.py; None: no local-prefill decisions

    @property
    def p_hit_ratio(self) -> float | None:
        return self.p_cached_tokens / self.prompt_tokens if self.prompt_tokens else None

    @property
    def d_hit_ratio(self) -> float | None:
        return self.d_cached_tokens / self.prompt_tokens if self.prompt_tokens else None


@dataclass(frozen=True)
class HitPrediction:
    """The router's predicted prefix hits against what one side's engines reported, over the
    successful requests that had a prediction."""

    requests: int
    predicted_tokens: int
    delivered_tokens: int
    prompt_tokens: int
    exact: int  # requests whose prediction equalled the engine's count
    over: int  # predicted more (blocks evicted, or events not yet seen by a removal)
    under: int  # predicted less (blocks stored after the pick, or events missed)
    pending_tokens: int = 0  # of predicted_tokens, those only pending (routed, not yet confirmed)
    pending_requests: int = 0  # requests whose prediction counted pending blocks

    @classmethod
    def of(cls, pairs: list[tuple[int, int, int, int]]) -> HitPrediction:
        """pairs: (predicted, delivered, prompt tokens, predicted of it pending) per request."""
        return cls(len(pairs), sum(p[0] for p in pairs), sum(p[1] for p in pairs), sum(p[2] for p in pairs),
                   sum(p[0] == p[1] for p in pairs), sum(p[0] > p[1] for p in pairs), sum(p[0] < p[1] for p in pairs),
                   sum(p[3] for p in pairs), sum(p[3] > 0 for p in pairs))


def _prefill_time_ratios(records: list[RequestRecord]) -> Ratios | None:
    ratios = []
    for r in records:
        took_ns = r.events.get("p_done", 0) - r.events.get("p_scheduled", 0)
        if r.predicted_p_prefill_s and "p_scheduled" in r.events and took_ns > 0 and not is_failed(r):
            ratios.append(r.predicted_p_prefill_s * 1e9 / took_ns)
    return Ratios.of(ratios)


def _predictions(records: list[RequestRecord]) -> dict[str, HitPrediction]:
    ok = [r for r in records if not is_failed(r)]
    out = {}
    for side, predicted, delivered, pending in (
            ("P", "predicted_p_hit_tokens", "p_cached_tokens", "predicted_p_pending_tokens"),
            ("D", "predicted_d_hit_tokens", "d_cached_tokens", None)):  # D counts confirmed blocks only
        pairs = [(getattr(r, predicted), getattr(r, delivered), r.prompt_tokens, pending and getattr(r, pending) or 0)
                 for r in ok if getattr(r, predicted) is not None]
        if pairs:
            out[side] = HitPrediction.of(pairs)
    return out


def run_origin_ns(run: Run) -> int:
    """Time zero of a run's plots: the first arrival (else the first event at all)."""
    arrivals = [r.events["arrival"] for r in run.records if "arrival" in r.events]
    if arrivals:
        return min(arrivals)
    return min((t for r in run.records for t in r.events.values()), default=0)


def last_event(rec: RequestRecord) -> str | None:
    reached = [e for e in EVENT_ORDER if e in rec.events and e != "finish"]
    return reached[-1] if reached else None


def is_failed(rec: RequestRecord) -> bool:
    return rec.error is not None or "first_token" not in rec.events


def error_kind(rec: RequestRecord) -> str:
    if rec.error is None:
        return "no error recorded"
    # Errors name the request and instance; the head before ':' is what groups alike failures.
    return rec.error.split(":", 1)[0].replace(rec.request_id, "<request>").strip()


def summarize(run: Run) -> Summary:
    atts: list[tuple[RequestRecord, Attribution]] = [(r, attribute(r)) for r in run.records]
    phases: dict[str, Stats] = {}
    path = critical_path(a for _, a in atts)
    for name in path:
        if s := Stats.of_ns([a.parts_ns[name] for _, a in atts if name in a.parts_ns]):
            phases[name] = s
    if s := Stats.of_ns([a.ttft_ns for _, a in atts if a.ttft_ns is not None]):
        phases["ttft"] = s
    complete = [a for _, a in atts if a.complete]
    ttft_sum = sum(a.ttft_ns for a in complete)
    shares = {n: sum(a.parts_ns.get(n, 0) for a in complete) / ttft_sum for n in path} if ttft_sum else {}
    by_interval: dict[str, list[int]] = {name: [] for name, *_ in INTERVALS}
    for r in run.records:
        for iv in intervals(r):
            by_interval[iv.name].append(iv.duration_ns)
    itl = [b - a for r in run.records for a, b in zip(r.token_ns, r.token_ns[1:])]
    tpot = [(r.events["last_token"] - r.events["first_token"]) // (r.output_tokens - 1) for r in run.records
            if r.output_tokens > 1 and "first_token" in r.events and "last_token" in r.events]
    groups: Counter[tuple[int, str]] = Counter()
    for r in run.records:
        for g in r.transfer_groups:
            groups[g.group, g.label] += g.bytes
    failed = [r for r in run.records if is_failed(r)]
    kinds = Counter((last_event(r), error_kind(r)) for r in failed)
    return Summary(
        run_id=run.meta.run_id, total=len(run.records), completed=len(run.records) - len(failed), failed=len(failed),
        phases=phases, shares=shares, attributed=len(complete),
        intervals={n: s for n, v in by_interval.items() if (s := Stats.of_ns(v))},
        itl=Stats.of_ns(itl), tpot=Stats.of_ns(tpot),
        prompt_tokens=sum(r.prompt_tokens for r in run.records),
        p_cached_tokens=sum(r.p_cached_tokens for r in run.records),
        p_tier_tokens=sum(r.p_tier_tokens for r in run.records),
        d_tier_tokens=sum(r.d_tier_tokens for r in run.records),
        pool_tokens=sum(r.pool_tokens for r in run.records),
        d_cached_tokens=sum(r.d_cached_tokens for r in run.records),
        transferred_tokens=sum(r.transferred_tokens for r in run.records),
        bytes_per_group={label: b for (_, label), b in sorted(groups.items())},
        recomputed=sum(1 for r in run.records if r.transfer_error),
        migrated=sum(1 for r in run.records if r.migrations),
        migrations=dict(sorted(Counter(m.role for r in run.records for m in r.migrations).items())),
        unfinished=len(run.unfinished),
        transfer_hidden_ns=sum(a.transfer_hidden_ns for _, a in atts if _has_transfer_split(a)),
        transfer_exposed_ns=sum(a.parts_ns["transfer"] for _, a in atts if _has_transfer_split(a)),
        failures=[Failure(r.request_id, last_event(r), r.error) for r in failed],
        failure_kinds=[FailureKind(s, k, c) for (s, k), c in sorted(kinds.items(), key=lambda kv: -kv[1])],
        policies=tuple(sorted({r.policy for r in run.records if r.policy})),
        predictions=_predictions(run.records),
        prefill_time_ratio=_prefill_time_ratios(run.records),
        local=local_summary(run.records),
        requests_per_instance=dict(sorted(Counter(i for r in run.records
                                                  for i in (r.prefill_instance, r.decode_instance) if i).items())),
        slowest=sorted(((r.request_id, a.ttft_ns) for r, a in atts if a.ttft_ns is not None), key=lambda x: -x[1])[:5],
    )


def human_bytes(n: float) -> str:
    """55072260096 -> '55.1 GB' (decimal units, as link rates are given)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return f"{n} TB"


def _has_transfer_split(a: Attribution) -> bool:
    return a.transfer_hidden_ns is not None and "transfer" in a.parts_ns


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _stats_row(label: str, s: Stats | None, share: str = "") -> str:
    if s is None:
        return f"  {label:<14}{'-':>6}"
    return (f"  {label:<14}{s.n:>6}{s.mean_ms:>10.2f}{s.p50_ms:>10.2f}{s.p90_ms:>10.2f}{s.p99_ms:>10.2f}"
            f"{share:>8}").rstrip()


def format_summary(s: Summary) -> str:
    head_no_share = f"  {'':<14}{'n':>6}{'mean ms':>10}{'p50 ms':>10}{'p90 ms':>10}{'p99 ms':>10}"
    head = f"{head_no_share}{'share':>8}"
    unfinished = f", {s.unfinished} unfinished (their router stopped first)" if s.unfinished else ""
    lines = [f"run {s.run_id}: {s.total} requests, {s.completed} completed, {s.failed} failed{unfinished}", "",
             f"TTFT critical path (shares over {s.attributed} complete requests)", head]
    lines += [_stats_row(n, s.phases.get(n), _pct(s.shares.get(n))) for n in CRITICAL_PATH
              if n not in OPTIONAL_PARTS or n in s.phases]
    lines += [_stats_row("TTFT", s.phases.get("ttft"), "100.0%" if s.shares else "-"), "",
              "phase intervals (they may overlap)", head_no_share]
    lines += [_stats_row(n, s.intervals.get(n)) for n, *_ in INTERVALS if n in s.intervals]
    p_tier = f", {s.p_tier_tokens} from its host tier" if s.p_tier_tokens else ""
    d_tier = f", {s.d_tier_tokens} from its host tier" if s.d_tier_tokens else ""
    pool = f" ({s.pool_tokens} read from a P's host tier)" if s.pool_tokens else ""
    lines += ["", "decode", head_no_share,
              _stats_row("ITL", s.itl), _stats_row("TPOT", s.tpot), "",
              (f"tokens: prompt {s.prompt_tokens}, P cached {s.p_cached_tokens} (hit {_pct(s.p_hit_ratio)}{p_tier}), "
              f"D cached {s.d_cached_tokens} (hit {_pct(s.d_hit_ratio)}{d_tier}), transferred {s.transferred_tokens}"
               f"{pool}")]
    groups = ", ".join(f"{g}: {human_bytes(b)}" for g, b in s.bytes_per_group.items()) or "none"
    lines.append(f"KV bytes transferred: {groups}")
    if moved := s.transfer_hidden_ns + s.transfer_exposed_ns:
        lines.append(f"KV transfer time: {s.transfer_hidden_ns / 1e6:.1f} ms hidden under prefills "
                     f"({_pct(s.transfer_hidden_ns / moved)}), {s.transfer_exposed_ns / 1e6:.1f} ms on the critical path")
    if s.recomputed:
        lines.append(f"KV pull failed, D recomputed: {s.recomputed} requests")
    if s.migrated:
        moves = ", ".join(f"{n} off a lost {role}" for role, n in s.migrations.items())
        lines.append(f"moved off a lost instance: {s.migrated} requests ({moves})")
    if s.slowest:
        lines += ["", "slowest TTFT (pdc timeline show RUN ID for one):"]
        lines += [f"  {rid}  {ns / NS_PER_MS:,.2f} ms" for rid, ns in s.slowest]
    lines += _routing_lines(s)
    if s.local is not None:
        lines += format_local(s.local)
    if s.failures:
        lines += ["", f"failed requests: {s.failed}", f"  {'count':>5}  {'stopped after':<16}error"]
        lines += [f"  {k.count:>5}  {k.stopped_after or '(nothing)':<16}{k.kind}" for k in s.failure_kinds]
        lines += [f"    {f.request_id}: after {f.stopped_after or '(nothing)'}: {f.error or 'no error recorded'}"
                  for f in s.failures[:20]]
        if len(s.failures) > 20:
            lines.append(f"    ... and {len(s.failures) - 20} more")
    return "\n".join(lines)


def _bar(start: int, end: int, t0: int, span: int, width: int) -> str:
    a = (start - t0) * width // span
    b = -(-(end - t0) * width // span)  # ceil: a short phase still shows
    if b <= a:
        return " " * a + "▏"  # zero (or negative: out of order) duration
    return " " * a + "█" * (b - a)


def _routing_lines(s: Summary) -> list[str]:
    if not s.policies:
        return []
    lines = ["", f"routing: {', '.join(s.policies)}"]
    for side, h in s.predictions.items():
        share = h.prompt_tokens or 1
        pending = (f" ({_pct(h.pending_tokens / share)} of it pending, in {h.pending_requests} requests)"
                   if h.pending_requests else "")
        lines.append(f"  {side} hit predicted {_pct(h.predicted_tokens / share)}{pending}, delivered "
                     f"{_pct(h.delivered_tokens / share)}; "
                     f"per request: {h.exact} exact, {h.over} over, {h.under} under (of {h.requests})")
    if r := s.prefill_time_ratio:
        lines.append(f"  P prefill time predicted / taken: median {r.p50:.2f}x (p10 {r.p10:.2f}x, p90 {r.p90:.2f}x; "
                     f"{r.n} requests)")
    lines.append("  requests: " + ", ".join(f"{name} {n}" for name, n in s.requests_per_instance.items()))
    return lines


def format_waterfall(run: Run, request_id: str, width: int = 72) -> str:
    rec = run.record(request_id)  # KeyError naming the request and the run
    att = attribute(rec)
    ev = rec.events
    lines = [(f"request {rec.request_id}: P {rec.prefill_instance or '-'} -> D {rec.decode_instance or '-'}, "
             f"finish {rec.finish_reason or '-'}")]
    if not ev:
        lines.append("no events recorded")
    else:
        t0 = ev.get("arrival", min(ev.values()))
        span = max(1, max(ev.values()) - t0)
        prefix = f"  {'phase':<13}{'where':<9}{'start ms':>10}{'dur ms':>10}  "  # the bar starts after it
        bar_w = max(10, width - len(prefix))
        lines += [f"span {span / NS_PER_MS:.3f} ms from {'arrival' if 'arrival' in ev else 'first event'}",
                  prefix.rstrip()]
        for iv in intervals(rec):
            lines.append(f"  {iv.name:<13}{iv.where:<9}{(iv.start_ns - t0) / NS_PER_MS:>10.3f}"
                         f"{iv.duration_ns / NS_PER_MS:>10.3f}  {_bar(iv.start_ns, iv.end_ns, t0, span, bar_w)}")
    ttft = f"{att.ttft_ns / NS_PER_MS:.3f} ms" if att.ttft_ns is not None else "not reached"
    lines += ["", f"TTFT {ttft}; critical path:"]
    for name in critical_path([att]):
        if name in att.parts_ns:
            share = f"{100 * att.parts_ns[name] / att.ttft_ns:6.1f}%" if att.ttft_ns else ""
            lines.append(f"  {name:<13}{att.parts_ns[name] / NS_PER_MS:>10.3f} ms {share}".rstrip())
        else:
            lines.append(f"  {name:<13}{'-':>10}")
    groups = ", ".join(f"{g.label}: {g.blocks} blocks {human_bytes(g.bytes)}" for g in rec.transfer_groups) or "none"
    p_tier = f" ({rec.p_tier_tokens} from its host tier)" if rec.p_tier_tokens else ""
    d_tier = f" ({rec.d_tier_tokens} from its host tier)" if rec.d_tier_tokens else ""
    pool = f" ({rec.pool_tokens} read from {rec.pool_instance}'s host tier)" if rec.pool_tokens else ""
    lines += ["", (f"tokens: prompt {rec.prompt_tokens}, P cached {rec.p_cached_tokens}{p_tier}, D cached "
                  f"{rec.d_cached_tokens}{d_tier}, transferred {rec.transferred_tokens}{pool}, output {rec.output_tokens}"),
              f"KV bytes: {groups}"]
    if rec.transfer_error:
        lines.append(f"KV pull failed, D recomputed: {rec.transfer_error}")
    if rec.pool_error:
        lines.append(f"the pool's read was not used, D computed the prefix: {rec.pool_error}")
    if bad := rec.out_of_order():
        lines.append("events out of order: " + ", ".join(f"{b} before {a}" for a, b in bad))
    if is_failed(rec):
        lines.append(f"FAILED: stopped after {last_event(rec) or '(nothing)'}: {rec.error or 'no error recorded'}")
    return "\n".join(lines)
