"""The pool for P (issue 29, docs/kv_tiers.md "The pool", spec router.p_pool) on the router's
side: when P reads the prompt's first blocks from a peer P's host tier (router/routing.py), and
the lifecycle's path through it (router/lifecycle.py, lifecycle_pool.py), driven by hand, on
hand-placed tiers."""

from __future__ import annotations

import pytest
from test_pool_routing import PROMPT, Inst, in_tier, last
from test_routing import BS, Clock, HeldBlocks

from pdcluster.proto.handle import TransferHandle
from pdcluster.proto.messages import EngineTimes, PoolOffer, PrefillResult, SamplingSpec, TransferStats
from pdcluster.router.dispatch import Dispatch
from pdcluster.router.lifecycle import Lifecycle
from pdcluster.router.lifecycle_commands import Failure, OpenPool, Prefill, Routed
from pdcluster.router.prefill_cost import FittedCost
from pdcluster.router.routing import InstancePicker


def picker(held: HeldBlocks, policy: str = "prefix_aware", p_pool: bool = True, cost=None) -> InstancePicker:
    ps = [Inst(f"p{i}", f"engine-p{i}", f"10.0.0.{i}:1860{i}") for i in range(2)]
    return InstancePicker(policy, ps, [Inst("d0")], BS, held, clock=Clock(), cost=cost, p_pool=p_pool)


class PoolDear(FittedCost):
    """A pool token costs 100 computed ones: reading is never worth it."""

    def seconds(self, cached_tokens: int, prompt_tokens: int, tier_tokens: int = 0, pool_tokens: int = 0) -> float:
        return super().seconds(cached_tokens, prompt_tokens, tier_tokens) + 100 * self.per_token_s * pool_tokens


def test_the_picked_p_reads_the_run_a_peers_tier_holds_past_its_own_hit():
    route = picker(in_tier(p1=20), policy="round_robin").pick(PROMPT, 4)  # turn 0: p0
    assert route.prefill.name == "p0" and route.pool.name == "p1" and route.pool_tokens == 20
    assert route.predicted_p_hit_tokens == 20 and route.predicted_p_tier_tokens == 0 and not route.local_prefill


def test_prefix_aware_sends_a_family_to_an_idle_p_that_reads_the_busy_holders_tier():
    pk = picker(in_tier(p1=20))
    first = pk.pick(PROMPT, 4)  # the holder: its own tier's run, no read
    assert first.prefill.name == "p1" and first.pool is None and first.predicted_p_hit_tokens == 20
    with pk.prefilling(first, len(PROMPT)):  # p1 busy: p0 gets the same run from p1's tier
        second = pk.pick(PROMPT, 4)
    assert (second.prefill.name, second.pool.name, second.pool_tokens) == ("p0", "p1", 20)


def test_no_read_when_off_when_no_peer_holds_more_or_when_computing_is_cheaper():
    assert picker(in_tier(p1=20), "round_robin", p_pool=False).pick(PROMPT, 4).pool is None
    held = in_tier(p1=12)
    held.store("p0", PROMPT[:16])  # p0's device holds more than p1's tier
    route = picker(held, "round_robin").pick(PROMPT, 4)
    assert route.prefill.name == "p0" and route.pool is None and route.predicted_p_hit_tokens == 16
    assert picker(in_tier(p1=20), "round_robin", cost=PoolDear()).pick(PROMPT, 4).pool is None


# -- the lifecycle's path


def lifecycle(held: HeldBlocks, mode: str) -> tuple[Dispatch, Lifecycle]:
    disp = Dispatch(picker(held, "round_robin"), transfer_mode=mode, request_timeout_s=60)
    return disp, Lifecycle(disp, "r0", list(PROMPT), SamplingSpec(max_tokens=4), arrival_ns=100)


def answer(prefill: Prefill, pool_tokens: int, error: str | None = None) -> PrefillResult:
    read = TransferStats(d_cached_tokens=0, transferred_tokens=pool_tokens)
    return PrefillResult(prefill.request.request_id, None, len(PROMPT), pool_tokens if error is None else 0,
                         EngineTimes(120, 130, 140), p_pool_tokens=pool_tokens if error is None else 0,
                         p_pool=read if error is None else read.failed(error, end_ns=135))


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_the_holders_offer_comes_first_then_p_reads_it_and_d_gets_ps_kv(mode):
    disp, lc = lifecycle(in_tier(p1=20), mode)
    routed, pool = lc.start(105)
    assert isinstance(routed, Routed) and isinstance(pool, OpenPool) and pool.instance.name == "p1"
    assert lc.waiting_for_pool and not lc.waiting_for_prefill and not lc.waiting_for_decode
    rid = pool.request.transfer_id
    *decode, prefill = lc.pool_opened(0, PoolOffer(rid, 16), 110)  # the tier lost a block since
    assert isinstance(prefill, Prefill) and prefill.instance.name == "p0"
    assert prefill.request.pool == TransferHandle("engine-p1", "10.0.0.1:18601", rid, 16, "grpc")
    ps_kv = TransferHandle("engine-p0", "10.0.0.0:18600", prefill.request.transfer_id, len(PROMPT), "grpc")
    if mode == "push":  # D asks P (not the holder) for the whole prompt while P computes it
        assert [d.request.handle for d in decode] == [ps_kv]
    else:
        assert decode == [] and [d.request.handle for d in lc.prefill_answered(0, answer(prefill, 16), 150)] == [ps_kv]
    if mode == "push":
        assert lc.prefill_answered(0, answer(prefill, 16), 150) == []
    emit, _, finished = lc.decode_output(0, last(TransferStats(d_cached_tokens=0, transferred_tokens=24)), 200)
    assert finished.error is None and emit.chunk.pd.pool_tokens == 16 and emit.chunk.pd.p_cached_tokens == 16
    rec = lc.close(210)
    assert (rec.pool_instance, rec.predicted_pool_tokens, rec.pool_tokens, rec.pool_error) == ("p1", 20, 16, None)
    assert rec.prefill_instance == "p0" and not rec.local_prefill and rec.transferred_tokens == 24
    assert not any(disp.picker.in_flight().values())


def test_no_offer_or_a_read_that_failed_leaves_p_computing_it_and_the_record_says_why():
    _, lc = lifecycle(in_tier(p1=20), "pull")
    lc.start(105)
    [prefill] = lc.pool_failed(0, Failure("lost", "its connection closed"), 110)
    assert prefill.request.pool is None
    assert lc.rec.pool_error == "p1 did not offer the prefix (lost): its connection closed"
    _, lc = lifecycle(in_tier(p1=20), "pull")
    lc.start(105)
    [prefill] = lc.pool_opened(0, PoolOffer("t", 20), 110)
    [decode] = lc.prefill_answered(0, answer(prefill, 20, error="p1 went away"), 150)
    *_, finished = lc.decode_output(0, last(TransferStats(d_cached_tokens=0, transferred_tokens=24)), 200)
    rec = lc.close(210)
    assert finished.error is None and rec.pool_tokens == 0 and rec.p_cached_tokens == 0
    assert rec.pool_error == "P's read from p1's tier failed (P computed it): p1 went away"

