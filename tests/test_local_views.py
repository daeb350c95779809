"""Local prefills in a run's summary (router/local_views.py), on hand-made records."""

from __future__ import annotations

from pdcluster.router.local_views import format_local, local_summary
from pdcluster.router.timeline import RequestRecord

MS = 1_000_000


def record(rid: str, d: str, arrival: int, first_token: int, tokens: list[int], local: bool = False,
           window: tuple[int, int] | None = None, reason: str = "long_remainder") -> RequestRecord:
    events = {"arrival": arrival * MS, "first_token": first_token * MS}
    if window:
        events |= {"d_scheduled": window[0] * MS, "d_first_token": window[1] * MS}
    return RequestRecord(rid, decode_instance=d, events=events, token_ns=[t * MS for t in tokens],
                         output_tokens=len(tokens), local_prefill=local, prefill_reason=reason)


def test_local_prefills_are_counted_and_the_steps_they_share_are_marked():
    records = [
        record("local", "d0", 95, 201, [201, 230], local=True, window=(100, 200), reason="short_remainder"),
        # Decoding on d0 meanwhile: gaps 90-150, 150-190 and 190-250 overlap d0's local prefill.
        record("other", "d0", 0, 50, [50, 90, 150, 190, 250, 300]),
        record("elsewhere", "d1", 0, 60, [60, 120, 180]),  # d1 ran no local prefill
    ]
    s = local_summary(records)
    assert (s.local, s.remote, s.reasons) == (1, 2, {"long_remainder": 2, "short_remainder": 1})
    assert s.ttft_local.mean_ms == 106 and s.ttft_remote.mean_ms == 55
    assert s.itl_during_local.n == 3 and s.itl_during_local.mean_ms == (60 + 40 + 60) / 3
    # The local request's own gap (201-230) is after its window: not its own interference.
    assert s.itl_without_local.n == 5 and s.itl_without_local.mean_ms == (40 + 50 + 29 + 60 + 60) / 5
    text = "\n".join(format_local(s))
    assert "local prefill: 1 of 3 completed requests on D alone (33.3%)" in text
    assert "during a local prefill:  mean 53.33 ms" in text


def test_a_run_without_decisions_has_no_local_summary():
    r = record("a", "d0", 0, 10, [10, 20])
    r.prefill_reason = None
    assert local_summary([r]) is None
