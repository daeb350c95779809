"""attribute()/intervals() on hand-made event sets, plus the clock-offset arithmetic."""

from __future__ import annotations

from pdcluster.router.attribution import CRITICAL_PATH, OPTIONAL_PARTS, Interval, attribute, critical_path, intervals
from pdcluster.router.timeline import ClockOffset, RequestRecord

T = 7_000_000_000  # an arbitrary router-clock origin; all times below are T + explicit ns


def rec(error: str | None = None, **events_ns: int) -> RequestRecord:
    return RequestRecord("req", events={e: T + ns for e, ns in events_ns.items()}, error=error)


PLAIN = {"arrival": 0, "dispatch": 100, "p_queued": 300, "p_scheduled": 1_000, "p_done": 11_000, "d_queued": 11_500,
             "transfer_start": 12_000, "transfer_end": 15_000, "d_kv_ready": 15_200, "d_scheduled": 16_000,
             "d_first_token": 18_000, "first_token": 18_700, "last_token": 30_000, "finish": 30_100}


def test_plain_request():
    a = attribute(rec(**PLAIN))
    # queue 1000-0, prefill 11000-1000, transfer [12000,15000] all after p_done, d_wait (16000-11000)-3000
    assert a.parts_ns == {"queue": 1_000, "prefill": 10_000, "transfer": 3_000, "d_wait": 2_000,
                          "first_decode": 2_700}
    assert a.ttft_ns == 18_700 == sum(a.parts_ns.values())
    assert (a.stopped_after, a.error, a.complete) == (None, None, True)
    assert list(a.parts_ns) == [n for n in CRITICAL_PATH if n not in OPTIONAL_PARTS]


def test_a_tier_load_is_its_own_part_cut_from_the_prefill_and_the_parts_still_sum_to_ttft():
    a = attribute(rec(**dict(PLAIN, p_tier_loaded=1_300)))
    assert a.parts_ns == {"queue": 1_000, "tier_load": 300, "prefill": 9_700, "transfer": 3_000, "d_wait": 2_000,
                          "first_decode": 2_700}
    assert a.ttft_ns == sum(a.parts_ns.values()) and a.complete
    assert critical_path([a]) == ("queue", "tier_load", "prefill", "transfer", "d_wait", "first_decode")
    assert critical_path([attribute(rec(**PLAIN))])[1] == "prefill"  # none had one: not shown
    ivs = {iv.name: iv for iv in intervals(rec(**dict(PLAIN, p_tier_loaded=1_300)))}
    assert ivs["tier_load"] == Interval("tier_load", "prefill", T + 1_000, T + 1_300)
    assert rec(**dict(PLAIN, p_tier_loaded=1_300)).out_of_order() == []


def test_ds_tier_load_is_its_own_part_cut_from_ds_wait_where_it_runs_after_p_is_done():
    # D loads 11,600-11,900 (after p_done at 11,000), then pulls 12,000-15,000.
    a = attribute(rec(**dict(PLAIN, d_tier_load_start=11_600, d_tier_loaded=11_900)))
    assert a.parts_ns == {"queue": 1_000, "prefill": 10_000, "d_tier_load": 300, "transfer": 3_000, "d_wait": 1_700,
                          "first_decode": 2_700}
    assert a.ttft_ns == sum(a.parts_ns.values()) and a.complete
    assert critical_path([a]) == ("queue", "prefill", "d_tier_load", "transfer", "d_wait", "first_decode")
    # With a push D loads while P computes: only what runs past p_done is on the path.
    pushed = attribute(rec(**dict(PLAIN, d_tier_load_start=10_800, d_tier_loaded=11_100)))
    assert (pushed.parts_ns["d_tier_load"], pushed.parts_ns["d_wait"]) == (100, 1_900)
    ivs = {iv.name: iv for iv in intervals(rec(**dict(PLAIN, d_tier_load_start=11_600, d_tier_loaded=11_900)))}
    assert ivs["d_tier_load"] == Interval("d_tier_load", "decode", T + 11_600, T + 11_900)
    assert rec(**dict(PLAIN, d_tier_load_start=11_600, d_tier_loaded=11_900)).out_of_order() == []


LOCAL = {"arrival": 0, "dispatch": 100, "d_queued": 400, "d_scheduled": 900, "d_first_token": 4_000,
         "first_token": 4_600, "last_token": 9_000, "finish": 9_100}


def test_a_request_d_prefilled_itself_has_its_own_phase_and_still_sums_to_ttft():
    r = rec(**LOCAL)
    r.local_prefill = True
    a = attribute(r)
    assert a.parts_ns == {"queue": 900, "prefill": 0, "transfer": 0, "d_wait": 0, "first_decode": 0,
                          "local_prefill": 3_700}
    assert a.ttft_ns == 4_600 == sum(a.parts_ns.values()) and a.complete
    ivs = {iv.name: iv for iv in intervals(r)}
    assert "first_decode" not in ivs and ivs["local_prefill"] == Interval("local_prefill", "decode", T + 900, T + 4_000)
    # The same events on a remote prefill's record: D's first decode step, not a prefill.
    assert "local_prefill" not in {iv.name for iv in intervals(rec(**LOCAL))}


def test_plain_intervals():
    ivs = {iv.name: iv for iv in intervals(rec(**PLAIN))}
    assert list(ivs) == ["router", "to_p", "p_queue", "prefill", "handoff", "d_queue", "transfer", "d_kv_wait",
                         "first_decode", "return", "decode"]
    # Arrival to first token with no gap: the hop to P's queue has a name of its own.
    assert ivs["router"].end_ns == ivs["to_p"].start_ns and ivs["to_p"].end_ns == ivs["p_queue"].start_ns
    assert ivs["transfer"] == Interval("transfer", "transfer", T + 12_000, T + 15_000)
    assert ivs["handoff"].where == "router" and ivs["handoff"].duration_ns == 500
    assert ivs["d_kv_wait"].duration_ns == 1_000 and ivs["decode"].duration_ns == 11_300


def test_transfer_overlapping_prefill_counts_only_after_p_done():
    # a layer-wise pull: starts at 6000 while P still computes, ends 2000 ns after p_done
    ev = dict(PLAIN, d_queued=5_000, transfer_start=6_000, transfer_end=13_000, d_kv_ready=13_500,
              d_scheduled=14_000)
    a = attribute(rec(**ev))
    assert a.parts_ns["transfer"] == 2_000  # [11000, 13000]: the part not hidden under the prefill
    assert a.parts_ns["d_wait"] == 1_000  # (14000 - 11000) - 2000
    assert a.ttft_ns == 18_700 == sum(a.parts_ns.values())
    ivs = {iv.name: iv for iv in intervals(rec(**ev))}
    assert ivs["transfer"].duration_ns == 7_000  # the interval itself is the whole pull, overlap and all


def test_transfer_entirely_hidden_under_prefill():
    ev = dict(PLAIN, d_queued=2_000, transfer_start=3_000, transfer_end=10_000, d_kv_ready=10_500,
              d_scheduled=12_000)
    a = attribute(rec(**ev))
    assert a.parts_ns["transfer"] == 0
    assert a.parts_ns["d_wait"] == 1_000  # 12000 - 11000: all of it waiting, none pulling
    assert sum(a.parts_ns.values()) == a.ttft_ns == 18_700


def test_failed_during_transfer():
    ev = {k: PLAIN[k] for k in ("arrival", "dispatch", "p_queued", "p_scheduled", "p_done", "d_queued",
                                "transfer_start")}
    a = attribute(rec(error="kv pull failed", finish=40_000, **ev))
    assert a.ttft_ns is None and not a.complete
    assert a.stopped_after == "transfer_start"  # "finish" is not progress
    assert a.parts_ns == {"queue": 1_000, "prefill": 10_000}  # only parts with both bounds
    assert a.error == "kv pull failed"
    # the transfer interval needs transfer_end: not drawn
    assert [iv.name for iv in intervals(rec(**ev))] == ["router", "to_p", "p_queue", "prefill", "handoff", "d_queue"]


def test_first_token_without_arrival_has_no_ttft():
    a = attribute(rec(first_token=5, d_scheduled=1))
    assert a.ttft_ns is None and a.stopped_after is None
    assert a.parts_ns == {"first_decode": 4}


def test_no_events_at_all():
    r = RequestRecord("empty", error="rejected")
    a = attribute(r)
    assert (a.parts_ns, a.ttft_ns, a.stopped_after, a.error, a.complete) == ({}, None, None, "rejected", False)
    assert intervals(r) == [] and r.out_of_order() == []


def test_out_of_order_detection():
    assert rec(**PLAIN).out_of_order() == []
    bad = rec(**dict(PLAIN, d_scheduled=14_000))  # before transfer_end (15000) and d_kv_ready (15200)
    assert bad.out_of_order() == [("d_kv_ready", "d_scheduled")]
    # only adjacent PRESENT events are compared: a missing one in between does not hide the jump back
    assert rec(arrival=10, p_done=5).out_of_order() == [("arrival", "p_done")]
    assert rec(arrival=10, dispatch=10).out_of_order() == []  # equal times are in order


def test_clock_offset_measure_and_to_router():
    # router asked at 1000, answered at 1400 (mid 1200); the instance said 51200: it runs 50000 ahead
    off = ClockOffset.measure(1_000, 51_200, 1_400)
    assert off == ClockOffset(offset_ns=50_000, uncertainty_ns=200)
    assert off.to_router(60_000) == 10_000
    assert ClockOffset.measure(0, -5, 3) == ClockOffset(-6, 2)  # odd round trip: mid floors, uncertainty rounds up
    assert ClockOffset(0, 0).to_router(123) == 123


# ---------------------------------------------------------------- layer-wise push

PUSH = dict(PLAIN, d_queued=400, transfer_start=600, transfer_end=11_300, d_kv_ready=11_600, d_scheduled=12_000)


def test_push_hidden_share_is_the_transfer_under_the_prefill():
    a = attribute(rec(**PUSH))
    # The transfer waited for P from 600 to 1000 (P's queue): not hidden, not on the path either.
    assert a.transfer_hidden_ns == 10_000  # [1000, 11000]
    assert a.parts_ns["transfer"] == 300  # [11000, 11300]
    assert a.ttft_ns == sum(a.parts_ns.values())


def test_pull_hides_nothing():
    assert attribute(rec(**PLAIN)).transfer_hidden_ns == 0
    assert attribute(rec(**{k: v for k, v in PLAIN.items() if k != "transfer_start"})).transfer_hidden_ns is None


def test_push_record_is_in_causal_order_and_drops_the_reversed_handoff():
    r = rec(**PUSH)
    assert r.out_of_order() == []
    names = [iv.name for iv in intervals(r)]
    assert "handoff" not in names and "transfer" in names


def test_push_d_scheduled_before_p_stamped_done_keeps_parts_non_negative():
    # D had every layer and ran before P's output (and its p_done stamp) left P's engine.
    a = attribute(rec(**dict(PUSH, transfer_end=10_900, d_kv_ready=10_950, d_scheduled=10_980)))
    assert a.parts_ns["prefill"] == 9_980 and a.parts_ns["transfer"] == 0 and a.parts_ns["d_wait"] == 0
    assert all(v >= 0 for v in a.parts_ns.values()) and a.ttft_ns == sum(a.parts_ns.values())


def test_out_of_order_still_flags_a_d_chain_reversal():
    assert rec(**dict(PUSH, transfer_end=500)).out_of_order() == [("transfer_start", "transfer_end")]


def test_push_first_token_before_p_done_is_in_order():
    # D had the KV after P's last attention layer and answered before P's own reply.
    ev = dict(PUSH, transfer_end=10_000, d_kv_ready=10_100, d_scheduled=10_200, d_first_token=10_500,
              first_token=10_800)
    r = rec(**ev)
    assert r.out_of_order() == []
    a = attribute(r)
    assert a.parts_ns["prefill"] == 9_200 and a.ttft_ns == 10_800 == sum(a.parts_ns.values())
