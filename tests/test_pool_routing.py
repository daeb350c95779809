"""The pool (issue 29, docs/kv_tiers.md "The pool") on the router's side: when D prefills a request
reading a P's host tier first (router/local_prefill.py, router/routing.py), and the lifecycle's
path through it (router/lifecycle.py), driven by hand, on hand-placed tiers."""

from __future__ import annotations

from dataclasses import dataclass

from test_routing import BS, Clock, HeldBlocks, family
from test_timeline_views import write_run

from pdcluster.proto.handle import TransferHandle
from pdcluster.proto.messages import DecodeDelta, EngineTimes, PoolOffer, SamplingSpec, TransferStats
from pdcluster.proto.router_spec import LocalPrefillSpec
from pdcluster.router.dispatch import Dispatch
from pdcluster.router.lifecycle import Lifecycle
from pdcluster.router.lifecycle_commands import Abort, Decode, Failure, OpenPool, Prefill, Routed
from pdcluster.router.local_prefill import LocalView, decide
from pdcluster.router.metrics import RouterMetrics
from pdcluster.router.report import render_report
from pdcluster.router.routing import InstancePicker
from pdcluster.router.run_store import load_run
from pdcluster.router.timeline import RequestRecord
from pdcluster.router.timeline_views import format_summary, format_waterfall, summarize

ON = LocalPrefillSpec(policy="short_remainder", max_tokens=8)
PROMPT = family(1, n=24)  # 6 blocks of 4; 5 can hit (the last token is always computed)


@dataclass(frozen=True)
class Inst:
    name: str
    engine_id: str = ""
    kv_address: str | None = None


def picker(held: HeldBlocks, spec: LocalPrefillSpec = ON) -> InstancePicker:
    ps = [Inst(f"p{i}", f"engine-p{i}", f"10.0.0.{i}:1860{i}") for i in range(2)]
    return InstancePicker("prefix_aware", ps, [Inst("d0")], BS, held, clock=Clock(), local=spec)


def in_tier(**runs: int) -> HeldBlocks:
    """Each named P's host tier holds the prompt's first `tokens`."""
    held = HeldBlocks()
    for p, tokens in runs.items():
        held.store(p, PROMPT[:tokens], where="tier")
    return held


def test_the_pool_counts_as_ds_hit_only_past_ds_own_and_only_when_on():
    view = LocalView(4096, 1024, False, 0, 0.0, pool_tokens=3584)
    d = decide(LocalPrefillSpec(policy="short_remainder", max_tokens=512), view)
    assert (d.local, d.reason, d.remainder_tokens, d.pool_tokens) == (True, "short_remainder", 512, 3584)
    off = decide(LocalPrefillSpec(policy="short_remainder", max_tokens=512, pool=False), view)
    assert (off.local, off.reason, off.pool_tokens) == (False, "long_remainder", 0)
    own = decide(LocalPrefillSpec(policy="short_remainder", max_tokens=512), LocalView(4096, 3584, False, 0, 0.0, 2048))
    assert (own.local, own.pool_tokens) == (True, 0)  # D's own hit is longer: nothing to read


def test_d_reads_the_longest_run_a_ps_tier_holds_and_computes_the_rest():
    route = picker(in_tier(p0=12, p1=20)).pick(PROMPT, 4)
    assert route.local_prefill and route.pool.name == "p1" and route.pool_tokens == 20
    assert route.local.remainder_tokens == 4 and route.predicted_d_hit_tokens == 0


def test_of_equal_runs_the_picked_p_holds_it_and_a_stale_index_is_not_read():
    held = in_tier(p0=20, p1=20)
    route = picker(held).pick(PROMPT, 4)
    assert route.pool.name == route.prefill.name
    held.stale_instances.add(route.prefill.name)
    assert picker(held).pick(PROMPT, 4).pool.name != route.prefill.name


def test_no_run_long_enough_or_the_pool_off_goes_through_p():
    assert not picker(in_tier(p0=8)).pick(PROMPT, 4).local_prefill  # 16 left: over 8
    route = picker(in_tier(p1=20)).pick(PROMPT, 4, pool=False)
    assert (route.local_prefill, route.pool, route.pool_tokens) == (False, None, 0)


# -- the lifecycle's pool path


def lifecycle(held: HeldBlocks) -> tuple[Dispatch, Lifecycle]:
    disp = Dispatch(picker(held), request_timeout_s=60)
    return disp, Lifecycle(disp, "r0", list(PROMPT), SamplingSpec(max_tokens=4), arrival_ns=100)


def last(transfer: TransferStats | None, reason: str = "length", tokens: tuple[int, ...] = (7, 8, 9, 10)) -> DecodeDelta:
    return DecodeDelta(list(tokens), reason, transfer, len(PROMPT), EngineTimes(160, 170, 180))


def test_d_reads_what_the_holder_offers_and_the_record_says_the_pool_gave_it():
    disp, lc = lifecycle(in_tier(p1=20))
    routed, pool = lc.start(105)
    assert isinstance(routed, Routed) and isinstance(pool, OpenPool) and pool.instance.name == "p1"
    assert pool.request.prompt_token_ids == PROMPT and pool.request.transfer_id == f"pdc-{disp.id_prefix}-0"
    assert lc.waiting_for_pool and not lc.waiting_for_decode
    [decode] = lc.pool_opened(0, PoolOffer(pool.request.transfer_id, 16), 110)  # the tier lost a block since
    assert isinstance(decode, Decode) and decode.instance.name == "d0"
    assert decode.request.handle == TransferHandle("engine-p1", "10.0.0.1:18601", pool.request.transfer_id, 16, "grpc")
    emit, abort, finished = lc.decode_output(0, last(TransferStats(d_cached_tokens=0, transferred_tokens=16)), 200)
    assert emit.chunk.pd.pool_tokens == 16 and emit.chunk.pd.local_prefill and finished.error is None
    rec = lc.close(210)
    assert (rec.pool_instance, rec.predicted_pool_tokens, rec.pool_tokens, rec.pool_error) == ("p1", 20, 16, None)
    assert rec.local_prefill and rec.transferred_tokens == 16
    assert not any(disp.picker.in_flight().values())


def test_an_empty_offer_or_a_holder_that_cannot_answer_leaves_d_computing_it_all():
    _, lc = lifecycle(in_tier(p1=20))
    lc.start(105)
    [decode] = lc.pool_opened(0, PoolOffer("t", 0), 110)
    assert decode.request.handle is None
    _, lc = lifecycle(in_tier(p1=20))
    lc.start(105)
    [decode] = lc.pool_failed(0, Failure("lost", "its connection closed"), 110)
    assert decode.request.handle is None
    *_, finished = lc.decode_output(0, last(None), 200)
    rec = lc.close(210)
    assert finished.error is None and rec.pool_tokens == 0
    assert rec.pool_error == "p1 did not offer the prefix (lost): its connection closed"


def test_a_read_that_fails_in_d_is_done_again_reading_no_tier():
    """The holder died mid-read (transfer.on_failure error): a new attempt, which goes through P
    (16 tokens are too many for D without the pool)."""
    disp, lc = lifecycle(in_tier(p1=20))
    lc.start(105)
    lc.pool_opened(0, PoolOffer("t", 20), 110)
    failed = TransferStats(d_cached_tokens=0, transferred_tokens=0).failed("P went away", end_ns=150)
    abort, routed, prefill = lc.decode_output(0, last(failed, "error", ()), 150)
    assert isinstance(abort, Abort) and isinstance(routed, Routed) and isinstance(prefill, Prefill)
    assert not routed.route.local_prefill and routed.route.pool is None
    assert lc.rec.pool_error == "D's read from p1's tier failed: P went away"
    assert (lc.rec.local_prefill, lc.rec.pool_instance) == (False, None)


def test_a_holder_that_never_answers_ends_in_a_504_naming_it():
    disp, lc = lifecycle(in_tier(p1=20))
    lc.start(105)
    *_, finished = lc.timed_out(200)
    assert finished.error.status == 504
    assert str(finished.error) == "p1's offer of r0's prefix did not come within 60 s"
    lc.close(210)
    assert not any(disp.picker.in_flight().values()) and disp.in_flight == 0


def pooled_record() -> RequestRecord:
    _, lc = lifecycle(in_tier(p1=20))
    lc.start(105)
    lc.pool_opened(0, PoolOffer("t", 20), 110)
    lc.decode_output(0, last(TransferStats(d_cached_tokens=0, transferred_tokens=20)), 200)
    return lc.close(210)


def test_the_files_views_and_metrics_say_what_the_pool_gave(tmp_path):
    rec = pooled_record()
    assert '"pool_instance":"p1","predicted_pool_tokens":20,"pool_tokens":20' in rec.to_json()
    assert "pool" not in RequestRecord("plain").to_json()  # runs without a pool: files as before
    run = load_run(write_run(tmp_path / "run", [rec]))
    back = run.record("r0")
    assert (back.pool_instance, back.predicted_pool_tokens, back.pool_tokens, back.pool_error) == ("p1", 20, 20, None)
    assert summarize(run).pool_tokens == 20
    assert "transferred 20 (20 read from a P's host tier)" in format_summary(summarize(run))
    assert "transferred 20 (20 read from p1's host tier), output 4" in format_waterfall(run, "r0")
    assert "transferred 20 (20 read from a P's host tier)" in render_report(run)
    metrics = RouterMetrics(lambda: {})
    metrics.observe(rec)
    assert 'pdc_tier_hit_tokens_total{side="decode",tier="pool"} 20.0' in metrics.render().decode()
