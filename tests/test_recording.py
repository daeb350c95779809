"""Filling request records from P/D reports, and the Prometheus metrics fed by them."""

from __future__ import annotations

import json

import pytest

from pdcluster.proto.messages import DecodeDelta, EngineTimes, PrefillResult, TransferStats
from pdcluster.router.metrics import RouterMetrics
from pdcluster.router.recording import record_decode_end, record_prefill
from pdcluster.router.timeline import ClockOffset, GroupTransfer, RequestRecord

MS = 1_000_000


def prefill_result(queued=10, scheduled=11, done=50, cached=256, tier=128):
    return PrefillResult("r", connector_params=None, prompt_tokens=1000, p_cached_tokens=cached,
                         engine=EngineTimes(queued * MS, scheduled * MS, done * MS), p_tier_tokens=tier)


def last_delta(error=None, **times):
    t = dict(start=55, end=60, ready=61, queued=54, scheduled=62, first=65) | times
    return DecodeDelta([7], finish_reason="length", num_cached_tokens=1000,
                       transfer=TransferStats(d_cached_tokens=128, transferred_tokens=872, blocks_per_group=(7,),
                                              bytes_per_group=(7 * 131072,), error=error,
                                              group_names=("full_attention (FullAttentionSpec)",),
                                              transfer_start_ns=t["start"] * MS, transfer_end_ns=t["end"] * MS,
                                              kv_ready_ns=t["ready"] * MS, d_tier_tokens=64),
                       engine=EngineTimes(t["queued"] * MS, t["scheduled"] * MS, t["first"] * MS))


def test_prefill_events_move_onto_the_router_clock():
    rec = RequestRecord("r")
    record_prefill(rec, prefill_result(), ClockOffset(offset_ns=2 * MS, uncertainty_ns=0))
    assert rec.events == {"p_queued": 8 * MS, "p_scheduled": 9 * MS, "p_done": 48 * MS}
    assert (rec.p_cached_tokens, rec.p_tier_tokens) == (256, 128)


def test_ps_tier_load_time_marks_when_the_load_ended_on_the_router_clock():
    from dataclasses import replace

    rec = RequestRecord("r")
    record_prefill(rec, replace(prefill_result(), p_tier_load_ns=3 * MS), ClockOffset(offset_ns=2 * MS, uncertainty_ns=0))
    assert rec.events["p_tier_loaded"] == 12 * MS  # P scheduled it at 11 (its clock), the load took 3
    rec = RequestRecord("r")
    record_prefill(rec, replace(prefill_result(scheduled=0), p_tier_load_ns=3 * MS), ClockOffset(0, 0))
    assert "p_tier_loaded" not in rec.events  # no start to measure from


def test_unrecorded_engine_times_stay_absent():
    rec = RequestRecord("r")
    record_prefill(rec, prefill_result(queued=0, scheduled=0, done=0), ClockOffset(0, 0))
    assert rec.events == {}


def test_decode_end_fills_transfer_and_d_events():
    rec = RequestRecord("r")
    record_decode_end(rec, last_delta(), ClockOffset(-1 * MS, 0))
    assert rec.events == {"d_queued": 55 * MS, "d_scheduled": 63 * MS, "d_first_token": 66 * MS,
                          "transfer_start": 56 * MS, "transfer_end": 61 * MS, "d_kv_ready": 62 * MS}
    assert (rec.d_cached_tokens, rec.d_tier_tokens, rec.transferred_tokens) == (128, 64, 872)
    assert rec.transfer_groups == [GroupTransfer(0, 7, 7 * 131072, "full_attention (FullAttentionSpec)")]
    assert rec.transfer_groups[0].label == "group 0 (full_attention (FullAttentionSpec))"
    assert rec.finish_reason == "length" and rec.transfer_error is None and rec.error is None


def test_ds_tier_load_marks_its_start_and_end_on_the_router_clock():
    from dataclasses import replace

    rec = RequestRecord("r")
    last = last_delta()
    # D queued it at 54 (its clock) and started the pull at 55: the load ran in between.
    load = dict(d_tier_load_start_ns=54 * MS + 200_000, d_tier_loaded_ns=54 * MS + 800_000)
    last = replace(last, transfer=replace(last.transfer, **load))
    record_decode_end(rec, last, ClockOffset(-1 * MS, 0))
    assert (rec.events["d_tier_load_start"], rec.events["d_tier_loaded"]) == (55 * MS + 200_000, 55 * MS + 800_000)
    assert rec.out_of_order() == []


def test_recomputed_transfer_is_noted_but_not_an_error():
    rec = RequestRecord("r")
    record_decode_end(rec, last_delta(error="KV pull from P failed"), ClockOffset(0, 0))
    assert rec.transfer_error == "KV pull from P failed" and rec.error is None


def test_clock_offset_from_one_round_trip():
    off = ClockOffset.measure(router_before_ns=100, instance_ns=1_000_150, router_after_ns=200)
    assert off == ClockOffset(offset_ns=1_000_000, uncertainty_ns=50)
    assert off.to_router(1_000_150) == 150


def _metric(text: str, line_prefix: str) -> float:
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(line_prefix))


def test_metrics_count_what_records_report():
    in_flight = {"prefill-0": 2, "decode-0": 1}
    m = RouterMetrics(lambda: in_flight)
    rec = RequestRecord("r", prompt_tokens=1000, p_cached_tokens=256, d_cached_tokens=128, transferred_tokens=872,
                        p_tier_tokens=128, d_tier_tokens=64, transfer_groups=[GroupTransfer(0, 7, 917504)], token_ns=[100 * MS, 110 * MS, 130 * MS])
    for name, t in [("arrival", 0), ("p_scheduled", 5), ("p_done", 50), ("transfer_start", 55),
                    ("transfer_end", 60), ("d_scheduled", 62), ("first_token", 100)]:
        rec.mark(name, t * MS)
    rec.predicted_p_hit_tokens, rec.predicted_d_hit_tokens = 384, 128  # P's index was ahead of its cache
    m.observe(rec)
    m.observe(RequestRecord("failed", error="prefill instance prefill-0 is unavailable"))
    text = m.render().decode()
    assert _metric(text, 'pdc_requests_total{outcome="ok"}') == 1
    assert _metric(text, 'pdc_requests_total{outcome="error"}') == 1
    assert _metric(text, "pdc_ttft_seconds_sum") == 0.1
    assert _metric(text, 'pdc_ttft_phase_seconds_sum{phase="transfer"}') == 0.005
    assert _metric(text, "pdc_inter_token_seconds_count") == 2
    assert _metric(text, 'pdc_cached_tokens_total{side="prefill"}') == 256
    assert _metric(text, 'pdc_cached_tokens_total{side="decode"}') == 128
    assert _metric(text, 'pdc_tier_hit_tokens_total{side="prefill",tier="host"}') == 128  # of P's 256
    assert _metric(text, 'pdc_tier_hit_tokens_total{side="decode",tier="host"}') == 64  # of D's 128
    assert _metric(text, 'pdc_transfer_bytes_total{group="0"}') == 917504
    assert _metric(text, 'pdc_predicted_cached_tokens_total{side="prefill"}') == 384
    assert _metric(text, 'pdc_hit_predictions_total{outcome="over",side="prefill"}') == 1
    assert _metric(text, 'pdc_hit_predictions_total{outcome="exact",side="decode"}') == 1
    assert 'pdc_hit_predictions_total{outcome="exact",side="prefill"} 0.0' in text  # every series from the start
    assert _metric(text, 'pdc_in_flight{instance="prefill-0"}') == 2
    assert "pdc_tier_blocks" not in text  # no feed of the tiers: no such series
    tiered = RouterMetrics(lambda: in_flight, tier_blocks={"prefill-0": (40, 7), "decode-0": (0, 0)}.get).render()
    assert _metric(tiered.decode(), 'pdc_tier_blocks{instance="prefill-0",tier="host"}') == 40
    assert _metric(tiered.decode(), 'pdc_tier_evicted_blocks_total{instance="prefill-0",tier="host"}') == 7
    in_flight["prefill-0"] = 0
    assert _metric(m.render().decode(), 'pdc_in_flight{instance="prefill-0"}') == 0


def test_metrics_count_local_and_remote_prefills_per_d_with_the_reason():
    m = RouterMetrics(lambda: {})
    for rid, local, reason in (("a", True, "short_remainder"), ("b", True, "short_remainder"), ("c", False, "d_busy"),
                               ("d", False, "long_remainder")):
        rec = RequestRecord(rid, decode_instance="decode-1", local_prefill=local, prefill_reason=reason)
        rec.mark("arrival", 0)
        m.observe(rec)
    m.observe(RequestRecord("off", decode_instance="decode-1"))  # local prefill off: no decision, not counted
    text = m.render().decode()
    assert _metric(text, 'pdc_prefills_total{decode="decode-1",reason="short_remainder",where="local"}') == 2
    assert _metric(text, 'pdc_prefills_total{decode="decode-1",reason="d_busy",where="remote"}') == 1
    assert _metric(text, 'pdc_prefills_total{decode="decode-1",reason="long_remainder",where="remote"}') == 1


def test_metrics_count_records_a_sink_could_not_take_per_sink():
    m = RouterMetrics(lambda: {})
    for sink in ("RunStore.append", "RunStore.begin", "RunStore.append"):
        m.record_failed(sink)
    text = m.render().decode()
    assert _metric(text, 'pdc_record_failures_total{sink="RunStore.append"}') == 2
    assert _metric(text, 'pdc_record_failures_total{sink="RunStore.begin"}') == 1


def test_a_local_prefills_record_takes_d_s_own_hit_from_its_last_delta():
    rec = RequestRecord("r", local_prefill=True)
    record_decode_end(rec, DecodeDelta([7], finish_reason="length", num_cached_tokens=896,
                                       engine=EngineTimes(54 * MS, 62 * MS, 65 * MS)), ClockOffset(0, 0))
    assert (rec.d_cached_tokens, rec.transferred_tokens, rec.events["d_scheduled"]) == (896, 0, 62 * MS)


def test_a_record_round_trips_through_its_json_line():
    from dataclasses import asdict

    rec = RequestRecord("r1", 12, 4, "prefill-0", "decode-0", "prefix_aware", 256, 0, 256, 0, 12,
                        [GroupTransfer(0, 3, 12288), GroupTransfer(1, 1, 64)], {"arrival": 5, "finish": 9},
                        [7_000, 11_000, 1_010_000], "length", None, None)
    line = rec.to_json()
    assert RequestRecord.from_dict(json.loads(line)) == rec
    written = asdict(rec)  # the same dict asdict() would write, token times as distances in us
    written["token_us"] = [7, 4, 999]  # 7, 11 and 1,010 us
    for absent in ("token_ns", "traceparent", "p_tier_tokens", "d_tier_tokens", "predicted_p_tier_tokens",
                   "predicted_d_tier_tokens", "pool_instance", "predicted_pool_tokens", "pool_tokens",
                   "pool_error"):  # none: left out
        del written[absent]
    assert json.loads(line) == written
    tiered = RequestRecord("r3", p_cached_tokens=256, p_tier_tokens=128, predicted_p_tier_tokens=128)
    assert json.loads(tiered.to_json())["p_tier_tokens"] == json.loads(tiered.to_json())["predicted_p_tier_tokens"] == 128
    assert RequestRecord.from_dict(json.loads(tiered.to_json())) == tiered
    traced = RequestRecord("r2", traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    assert RequestRecord.from_dict(json.loads(traced.to_json())) == traced
    assert rec.transfer_groups[0] == GroupTransfer(0, 3, 12288)  # the record itself untouched


def test_token_times_are_written_to_the_microsecond_without_drift_and_old_runs_still_read():
    # 1,000 tokens 10,000,400 ns apart: rounding each distance would drift 400 us by the end.
    token_ns = [123_456_789_000_000 + i * 10_000_400 for i in range(1000)]
    rec = RequestRecord("r1", token_ns=token_ns)
    back = RequestRecord.from_dict(json.loads(rec.to_json())).token_ns
    assert max(abs(a - b) for a, b in zip(back, token_ns)) <= 500
    assert len(rec.to_json()) < 7 * len(token_ns) + 400  # ~6 bytes a token (ns absolute: ~20)
    old = {**json.loads(rec.to_json()), "token_ns": token_ns}
    del old["token_us"]
    assert RequestRecord.from_dict(old).token_ns == token_ns


def _series(page: bytes) -> dict[tuple, float]:
    """Every sample of a /metrics page but the _created timestamps: (name, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(page.decode()) for s in fam.samples
            if not s.name.endswith("_created")}


def test_metrics_of_several_routers_merge_into_what_one_router_would_show():
    from pdcluster.router.metrics import merge_expositions

    def record(i: int, group: int) -> RequestRecord:
        rec = RequestRecord(f"r{i}", prompt_tokens=100 * i, p_cached_tokens=16 * i,
                            transfer_groups=[GroupTransfer(group, 1, 1000 * i)], token_ns=[i * MS, 3 * i * MS])
        rec.mark("arrival", 0)
        rec.mark("first_token", i * MS)
        return rec

    loads = [{"prefill-0": 1, "decode-0": 0}, {"prefill-0": 2, "decode-0": 3}]
    # Each router's index of the tiers, from the same events: the second a batch behind.
    tiers = [{"prefill-0": (40, 7), "decode-0": (0, 0)}, {"prefill-0": (38, 7), "decode-0": (0, 0)}]
    routers = [RouterMetrics(lambda load=load: load, tier_blocks=tier.get) for load, tier in zip(loads, tiers)]
    one = RouterMetrics(lambda: {"prefill-0": 3, "decode-0": 3}, tier_blocks=tiers[0].get)
    for i in range(1, 6):  # router 1 alone sees transfer group 1
        routers[i % 2].observe(record(i, group=i % 2))
        one.observe(record(i, group=i % 2))
    merged = merge_expositions([r.render() for r in routers])
    assert _series(merged) == pytest.approx(_series(one.render()))
    created = [float(line.split()[-1]) for line in merged.decode().splitlines()
               if line.startswith('pdc_requests_created{outcome="ok"}')]
    first = min(float(line.split()[-1]) for r in routers for line in r.render().decode().splitlines()
                if line.startswith('pdc_requests_created{outcome="ok"}'))
    assert created == [first]
