"""What local prefills did in a run (router/local_prefill.py): how many requests D served
alone, their TTFT beside the remote ones', and what they cost the requests D was decoding.

The interference is measured from the run's own records: every gap between two output
tokens of a request is one of its D's decode steps (or several, when the engine batched
its output), and it is marked when a local prefill ran on that D during it ([d_scheduled,
d_first_token] of a request D prefilled itself, other than the request's own). Those steps
carried a prompt chunk beside the decodes; the rest did not. The two ITL distributions
side by side are the interference.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass

from pdcluster.router.timeline import RequestRecord
from pdcluster.router.timeline_stats import Stats


@dataclass(frozen=True)
class LocalSummary:
    local: int  # requests D prefilled itself (completed)
    remote: int  # requests prefilled on P (completed), local prefill on
    reasons: dict[str, int]  # router/local_prefill.py Reason -> requests
    ttft_local: Stats | None
    ttft_remote: Stats | None
    # Other requests' inter-token gaps on the same D: during a local prefill there, and not.
    itl_during_local: Stats | None
    itl_without_local: Stats | None

    @property
    def local_share(self) -> float | None:
        return self.local / (self.local + self.remote) if self.local + self.remote else None


def _windows(records: list[RequestRecord]) -> dict[str, tuple[list[int], list[int], list[str]]]:
    """Per D, its local prefills' (start, end, request id), sorted by start."""
    spans: dict[str, list[tuple[int, int, str]]] = {}
    for r in records:
        ev = r.events
        if r.local_prefill and r.decode_instance and "d_scheduled" in ev and "d_first_token" in ev:
            spans.setdefault(r.decode_instance, []).append((ev["d_scheduled"], ev["d_first_token"], r.request_id))
    out = {}
    for d, s in spans.items():
        s.sort()
        out[d] = ([a for a, _, _ in s], [b for _, b, _ in s], [rid for _, _, rid in s])
    return out


def _during(windows: tuple[list[int], list[int], list[str]], a: int, b: int, own: str) -> bool:
    """Whether a local prefill (not `own`) overlaps the gap (a, b)."""
    starts, ends, ids = windows
    # Windows are short next to a run: look back from the last one starting before b.
    k = bisect.bisect_left(starts, b) - 1
    while k >= 0 and starts[k] > a - _LOOKBACK_NS:
        if ends[k] > a and ids[k] != own:
            return True
        k -= 1
    return False


_LOOKBACK_NS = 600 * 10**9  # no local prefill lasts 10 minutes


def local_summary(records: list[RequestRecord]) -> LocalSummary | None:
    """None when the run made no local-prefill decision (policy never, or an older run)."""
    decided = [r for r in records if r.prefill_reason is not None]
    if not decided:
        return None
    ok = [r for r in decided if r.error is None and "first_token" in r.events]
    ttft = {flag: [r.events["first_token"] - r.events["arrival"] for r in ok
                   if r.local_prefill is flag and "arrival" in r.events] for flag in (True, False)}
    windows = _windows(records)
    during, without = [], []
    for r in records:
        w = windows.get(r.decode_instance or "")
        for a, b in zip(r.token_ns, r.token_ns[1:]):
            (during if w is not None and _during(w, a, b, r.request_id) else without).append(b - a)
    return LocalSummary(
        local=sum(r.local_prefill for r in ok), remote=sum(not r.local_prefill for r in ok),
        reasons=dict(Counter(r.prefill_reason for r in decided).most_common()),
        ttft_local=Stats.of_ns(ttft[True]), ttft_remote=Stats.of_ns(ttft[False]),
        itl_during_local=Stats.of_ns(during), itl_without_local=Stats.of_ns(without))


def _ms(s: Stats | None) -> str:
    return "-" if s is None else f"mean {s.mean_ms:.2f} ms, p90 {s.p90_ms:.2f} ms ({s.n})"


def format_local(s: LocalSummary) -> list[str]:
    share = "-" if s.local_share is None else f"{100 * s.local_share:.1f}%"
    reasons = ", ".join(f"{k} {n}" for k, n in s.reasons.items())
    return ["", f"local prefill: {s.local} of {s.local + s.remote} completed requests on D alone ({share}); "
                f"decisions: {reasons}",
            f"  TTFT on D alone: {_ms(s.ttft_local)}",
            f"  TTFT through P:  {_ms(s.ttft_remote)}",
            "  other requests' ITL on the same D (decode steps):",
            f"    during a local prefill:  {_ms(s.itl_during_local)}",
            f"    without one:             {_ms(s.itl_without_local)}"]
