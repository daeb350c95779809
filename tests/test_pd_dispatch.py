"""Unit tests of the P/D request path (router/pd_dispatch.py) over fake engines (tests/dispatch_fakes.py)."""

from __future__ import annotations

import asyncio
import time

import pytest
from dispatch_fakes import (
    CARD,
    DIED,
    HANG,
    PROMPT,
    SAMPLING,
    FakeEngine,
    FakeRef,
    Method,
    collect,
    expect_error,
    make,
    run,
)

from pdcluster.proto.handle import TransferHandle
from pdcluster.proto.messages import (
    DecodeDelta,
    DecodeRequest,
    PrefillRequest,
    PrefillResult,
    TransferStats,
)
from pdcluster.router.pd_dispatch import Instance, PDDispatcher
from pdcluster.transfer.request_channel import EngineCallFailed, EngineUnavailable


def test_refuses_empty_prefill_or_decode_list():
    with pytest.raises(AssertionError):
        PDDispatcher([], [Instance("decode-0", FakeEngine())], CARD, 1.0)
    with pytest.raises(AssertionError):
        PDDispatcher([Instance("prefill-0", FakeEngine())], [], CARD, 1.0)


def test_round_robin_over_two_p_and_two_d(cancelled):
    ps, ds = [FakeEngine(), FakeEngine()], [FakeEngine(), FakeEngine()]
    disp = make(ps, ds)

    async def main():
        for i in range(4):
            await collect(disp, f"r{i}")

    run(main())
    assert [r.request_id for r in ps[0].prefill_calls] == ["r0", "r2"]
    assert [r.request_id for r in ps[1].prefill_calls] == ["r1", "r3"]
    assert [r.request_id for r in ds[0].decode_calls] == ["r0", "r2"]
    assert [r.request_id for r in ds[1].decode_calls] == ["r1", "r3"]
    assert cancelled == []


def test_chunks_and_decode_request_carry_prefill_results(cancelled):
    p, d = FakeEngine(p_cached=4), FakeEngine()
    disp = make([p], [d])
    chunks = run(collect(disp, "req-x"))

    assert [c.new_token_ids for c in chunks] == [[10], [11, 12], [13]]
    assert [c.finish_reason for c in chunks] == [None, None, "length"]
    assert all(c.p_cached_tokens == 4 for c in chunks)
    last = chunks[-1]
    assert (last.d_cached_tokens, last.transferred_tokens) == (2, 3)
    assert all((c.d_cached_tokens, c.transferred_tokens) == (0, 0) for c in chunks[:-1])

    (preq,) = p.prefill_calls
    assert preq == PrefillRequest("req-x", PROMPT, SAMPLING, transfer_id="req-x-0")
    (dreq,) = d.decode_calls
    assert dreq == DecodeRequest("req-x", PROMPT, SAMPLING, {"from": id(p), "rid": "req-x"})
    assert cancelled == []  # a normally finished stream is not cancelled


def test_dead_prefill_is_503_naming_the_instance(cancelled):
    p, d = FakeEngine(prefill_outcome=DIED), FakeEngine()
    err, got = run(expect_error(make([p], [d])))
    assert err.status == 503 and err.kind == "service_unavailable"
    assert "prefill-0" in str(err)
    assert got == [] and d.decode_calls == []


def test_unavailable_prefill_ray_actor_error_is_503(cancelled):
    p, d = FakeEngine(), FakeEngine()
    p2 = FakeEngine(prefill_outcome=EngineUnavailable("RayActorError (restarting)"))
    disp = make([p, p2], [d], migration_limit=0)  # (else it is retried on prefill-0: tests/test_migration.py)

    async def main():
        await collect(disp, "r0")
        return await expect_error(disp, "r1")

    err, _ = run(main())
    assert err.status == 503 and "prefill-1" in str(err)


def test_prefill_timeout_is_504_and_cancels_the_prefill(cancelled):
    p, d = FakeEngine(prefill_outcome=HANG), FakeEngine()
    t0 = time.monotonic()
    err, got = run(expect_error(make([p], [d], timeout=0.2)))
    elapsed = time.monotonic() - t0
    assert err.status == 504 and err.kind == "timeout"
    assert "prefill-0" in str(err)
    assert 0.15 <= elapsed < 1.0
    assert cancelled == [p.prefill_pending[0]]
    assert got == [] and d.decode_calls == []


def test_decode_timeout_is_504_and_cancels_the_stream(cancelled):
    d = FakeEngine(decode_script=[DecodeDelta([10]), HANG])
    t0 = time.monotonic()
    err, got = run(expect_error(make([FakeEngine()], [d], timeout=0.2)))
    elapsed = time.monotonic() - t0
    assert err.status == 504 and err.kind == "timeout"
    assert "decode-0" in str(err)
    assert 0.15 <= elapsed < 1.0
    assert [c.new_token_ids for c in got] == [[10]]
    assert cancelled == [d.decode_pending[0]]


def test_dead_decode_mid_stream_is_503_naming_the_instance(cancelled):
    d0 = FakeEngine()
    d1 = FakeEngine(decode_script=[DecodeDelta([10]), DIED])
    disp = make([FakeEngine()], [d0, d1], migration_limit=0)  # (else it moves on to decode-0: test_migration.py)

    async def main():
        await collect(disp, "r0")  # decode-0
        return await expect_error(disp, "r1")  # decode-1

    err, got = run(main())
    assert err.status == 503 and err.kind == "service_unavailable"
    assert "decode-1" in str(err)
    assert [c.new_token_ids for c in got] == [[10]]
    assert cancelled == []  # the engine is gone with the call: nothing to abort


def test_with_every_instance_of_a_role_down_it_is_503_at_once(cancelled):
    p, d = FakeEngine(connected=False), FakeEngine()
    err, got = run(expect_error(make([p], [d])))
    assert err.status == 503 and "no prefill instance is up (prefill-0 all down)" in str(err)
    assert got == [] and d.decode_calls == []


def test_a_down_instance_gets_no_new_request_until_it_is_back(cancelled):
    ps, ds = [FakeEngine(), FakeEngine(connected=False)], [FakeEngine(connected=False), FakeEngine()]
    disp = make(ps, ds)

    async def main(n: int):
        for i in range(n):
            await collect(disp, f"r{i}")

    run(main(4))  # round robin, over the survivors only
    assert (len(ps[0].prefill_calls), len(ps[1].prefill_calls)) == (4, 0)
    assert (len(ds[0].decode_calls), len(ds[1].decode_calls)) == (0, 4)
    ps[1].connected = ds[0].connected = True  # back (its channel reopened)
    run(main(4))
    assert len(ps[1].prefill_calls) == 2 and len(ds[0].decode_calls) == 2


def test_an_engine_error_is_500_naming_the_instance(cancelled):
    d = FakeEngine(decode_script=[EngineCallFailed("ValueError: the handle covers 9 tokens")])
    err, got = run(expect_error(make([FakeEngine()], [d])))
    assert err.status == 500 and "decode on decode-0 failed: ValueError: the handle covers 9 tokens" in str(err)
    assert got == [] and cancelled == []


def test_finish_reason_error_is_502_kv_transfer_error(cancelled):
    d = FakeEngine(decode_script=[DecodeDelta([], finish_reason="error", transfer=TransferStats(error="boom"))])
    err, got = run(expect_error(make([FakeEngine()], [d])))
    assert err.status == 502 and err.kind == "kv_transfer_error"
    assert "decode-0" in str(err) and "prefill-0" in str(err)
    assert got == []


def test_consumer_closing_early_cancels_the_stream_once(cancelled):
    d = FakeEngine()
    disp = make([FakeEngine()], [d])

    async def main():
        gen = disp.generate("r0", PROMPT, SAMPLING)
        first = await gen.__anext__()
        await gen.aclose()
        await gen.aclose()  # a second close is a no-op
        return first

    first = run(main())
    assert first.new_token_ids == [10] and first.finish_reason is None
    assert cancelled == [d.decode_pending[0]]


def test_stream_ending_without_finish_is_502(cancelled):
    d = FakeEngine(decode_script=[DecodeDelta([10]), DecodeDelta([11])])
    err, got = run(expect_error(make([FakeEngine()], [d])))
    assert err.status == 502
    assert "decode-0" in str(err) and "without a finish" in str(err)
    assert [c.new_token_ids for c in got] == [[10], [11]]


def test_health_reports_each_instance(cancelled):
    ps = [FakeEngine(), FakeEngine(health_outcome=DIED), FakeEngine(connected=False)]
    ds = [FakeEngine(health_outcome=RuntimeError("engine dead")), FakeEngine()]
    t0 = time.monotonic()
    health = run(make(ps, ds).health())
    # prefill-2: its actor answers, its request channel is down (reopening after a restart)
    assert health == {"prefill-0": True, "prefill-1": False, "prefill-2": False, "decode-0": False, "decode-1": True}
    assert time.monotonic() - t0 < 1.0


def test_cancelled_during_prefill_cancels_the_prefill(cancelled):
    # A client disconnect cancels the task driving the generator while P is still prefilling:
    # P's request (and the KV it would hold for D) must be aborted too.
    p, d = FakeEngine(prefill_outcome=HANG), FakeEngine()
    disp = make([p], [d])

    async def main():
        gen = disp.generate("r0", PROMPT, SAMPLING)

        async def first():
            return await gen.__anext__()

        task = asyncio.create_task(first())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await gen.aclose()

    run(main())
    assert cancelled == [p.prefill_pending[0]]
    assert d.decode_calls == []


# ---------------------------------------------------------------- push mode


def test_push_sends_d_the_router_built_handle_before_p_answers_and_d_finishes_without_p(cancelled):
    p, d = FakeEngine(prefill_outcome=HANG), FakeEngine()
    disp = make([p], [d], timeout=0.3, mode="push")
    got = run(collect(disp, "req-p"))
    # D got its request (and P's address) while P was still computing.
    (dreq,) = d.decode_calls
    assert dreq.handle == TransferHandle("e-p0", "10.0.0.1:5000", "req-p-0", len(PROMPT)).to_params()
    assert p.prefill_calls[0].transfer_id == "req-p-0"
    # D's tokens flow before P answers; P never did: the last waits for P until the deadline,
    # then goes without P's hit (D had every layer's KV: the request is whole), and P's call
    # is cancelled.
    assert [c.new_token_ids for c in got] == [[10], [11, 12], [13]] and got[-1].p_cached_tokens == 0
    assert p.prefill_pending[0] in cancelled


def test_push_dead_prefill_cancels_the_decode(cancelled):
    p, d = FakeEngine(prefill_outcome=DIED), FakeEngine()
    err, got = run(expect_error(make([p], [d], mode="push")))
    assert err.status == 503 and "prefill-0" in str(err)
    assert len(d.decode_calls) == 1 and d.decode_pending[0] in cancelled


def test_push_tokens_flow_and_the_last_carries_ps_hit(cancelled):
    p, d = FakeEngine(p_cached=4), FakeEngine()
    chunks = run(collect(make([p], [d], mode="push"), "req-q"))
    assert [c.new_token_ids for c in chunks] == [[10], [11, 12], [13]]
    assert chunks[-1].p_cached_tokens == 4 and cancelled == []


def test_push_dead_prefill_ends_a_waiting_decode_at_once(cancelled):
    p, d = FakeEngine(prefill_outcome=DIED), FakeEngine(decode_script=[HANG])
    t0 = time.monotonic()
    err, got = run(expect_error(make([p], [d], timeout=5.0, mode="push")))
    assert err.status == 503 and got == [] and time.monotonic() - t0 < 1.0
    assert d.decode_pending[0] in cancelled


def test_push_needs_every_p_address():
    with pytest.raises(AssertionError, match="KV address"):
        PDDispatcher([Instance("prefill-0", FakeEngine())], [Instance("decode-0", FakeEngine())], CARD, 1.0,
                     transfer_mode="push")


def test_transfer_ids_are_unique_when_request_ids_repeat(cancelled):
    p, d = FakeEngine(), FakeEngine()
    disp = make([p], [d], mode="push")

    async def main():
        await collect(disp, "same")
        await collect(disp, "same")

    run(main())
    assert [r.transfer_id for r in p.prefill_calls] == ["same-0", "same-1"]
    assert [TransferHandle.from_params(r.handle).transfer_id for r in d.decode_calls] == ["same-0", "same-1"]


def test_pull_asks_p_handle_for_the_routers_transport(cancelled):
    handle = TransferHandle("e-p0", "10.0.0.1:5000", "t-0", 5).to_params()
    p = FakeEngine(prefill_outcome=PrefillResult("r0", handle, 5, 0))
    d = FakeEngine()
    disp = make([p], [d])
    disp.transport = "torch_dist"
    run(collect(disp))
    assert TransferHandle.from_params(d.decode_calls[0].handle).transport == "torch_dist"


def test_push_handle_names_the_transport(cancelled):
    p, d = FakeEngine(), FakeEngine()
    disp = make([p], [d], mode="push")
    disp.transport = "torch_dist"
    run(collect(disp))
    assert TransferHandle.from_params(d.decode_calls[0].handle).transport == "torch_dist"


def records_of(disp: PDDispatcher) -> list:
    seen: list = []
    disp.sinks.append(seen.append)
    return seen


def test_batched_deltas_stamp_each_token_at_its_engine_time(cancelled):
    now = time.monotonic_ns()
    script = [DecodeDelta([10, 11], token_ns=(now - 3_000_000, now - 2_000_000)),
              DecodeDelta([12], finish_reason="length", token_ns=(now - 1_000_000,))]
    disp = make([FakeEngine()], [FakeEngine(decode_script=script)])
    records = records_of(disp)
    run(collect(disp))
    (rec,) = records
    # Router clock = D's clock here (no offset measured): the stamps are taken as they are.
    assert rec.token_ns == [now - 3_000_000, now - 2_000_000, now - 1_000_000]
    assert rec.events["first_token"] == now - 3_000_000 and rec.events["last_token"] == now - 1_000_000
    assert rec.output_tokens == 3


def test_deltas_queued_together_go_out_as_one_chunk_with_their_token_times(cancelled):
    now = time.monotonic_ns()
    script = [DecodeDelta([10], token_ns=(now - 3_000_000,)), DecodeDelta([11, 12], token_ns=(now - 2, now - 1)),
              HANG]
    disp = make([FakeEngine()], [FakeEngine(decode_script=script, decode_queued=True)], timeout=0.3)
    records = records_of(disp)
    err, chunks = run(expect_error(disp))
    assert err.status == 504
    assert [c.new_token_ids for c in chunks] == [[10, 11, 12]]  # then D hung: what was here went out at once
    assert records[0].token_ns == [now - 3_000_000, now - 2, now - 1]


def test_a_finish_queued_behind_deltas_ends_the_merged_chunk(cancelled):
    disp = make([FakeEngine()], [FakeEngine(decode_queued=True)])
    [chunk] = run(collect(disp))
    assert chunk.new_token_ids == [10, 11, 12, 13] and chunk.finish_reason == "length"
    assert (chunk.d_cached_tokens, chunk.transferred_tokens) == (2, 3)


def test_merging_deltas_keeps_times_only_when_every_token_has_one():
    a, b = DecodeDelta([1], token_ns=(5,)), DecodeDelta([2, 3], token_ns=(6, 7))
    assert a.then(b) == DecodeDelta([1, 2, 3], token_ns=(5, 6, 7))
    assert a.then(DecodeDelta([2])).token_ns == ()  # the router stamps them all on arrival
    assert DecodeDelta([]).then(b) == b
    fin = DecodeDelta([4], finish_reason="stop", transfer=TransferStats(transferred_tokens=9), token_ns=(8,))
    assert a.then(fin) == DecodeDelta([1, 4], "stop", TransferStats(transferred_tokens=9), token_ns=(5, 8))
    with pytest.raises(AssertionError, match="finished delta"):
        fin.then(a)


def test_prefix_aware_records_predictions_and_frees_its_counts(cancelled):
    class HoldsFirstBlock:
        def matched_blocks(self, instance, hashes):
            return 1 if instance == "prefill-1" else 0

    ps, ds = [FakeEngine(), FakeEngine(p_cached=4)], [FakeEngine()]
    disp = make(ps, ds, policy="prefix_aware", block_size=4, lookup=HoldsFirstBlock())
    records = records_of(disp)
    run(collect(disp))
    assert ps[1].prefill_calls and not ps[0].prefill_calls
    (rec,) = records
    assert (rec.policy, rec.predicted_p_hit_tokens, rec.predicted_d_hit_tokens) == ("prefix_aware", 4, 0)
    assert (rec.p_cached_tokens, rec.prefill_instance) == (4, "prefill-1")
    assert set(disp.in_flight.values()) == {0}


def info_of(name: str, node_ip: str, kv_port: int | None, engine_id: str):
    from pdcluster.proto.messages import InstanceInfo, PlaneAddresses

    role = name.split("-")[0]
    return InstanceInfo(name=name, role=role, index=0, node_ip=node_ip, pid=1,
                        kv_address=f"{node_ip}:{kv_port}" if kv_port else None, engine_id=engine_id, started_s=0.0,
                        planes=PlaneAddresses(node_ip, f"{node_ip}:7000", f"tcp://{node_ip}:7001",
                                              f"tcp://{node_ip}:7002"))


def test_an_instance_restarted_on_another_node_is_dialled_at_its_new_addresses(cancelled):
    """Ray restarted prefill-0 elsewhere: the refresh on its channel's reconnection gives push
    mode P's new KV address, re-measures its clock and tells the listeners (the KV-event feed)."""
    p, d = FakeEngine(), FakeEngine()
    disp = make([p], [d], mode="push")
    heard = []
    disp.instance_listeners.append(heard.append)
    p.clock = Method(lambda: FakeRef(time.monotonic_ns() + 5_000_000_000))  # the new host's clock: +5 s
    for info in (info_of("prefill-0", "10.0.0.1", 5000, "e-p0"), info_of("prefill-0", "10.0.0.7", 5000, "e-p0")):
        p.info = Method(lambda info=info: FakeRef(info))
        run(disp.refresh_instance("prefill-0"))
    assert [i.node_ip for i in heard] == ["10.0.0.1", "10.0.0.7"]
    assert disp.prefill[0].kv_address == disp.picker.prefill[0].kv_address == "10.0.0.7:5000"
    assert abs(disp.clocks["prefill-0"].offset_ns - 5_000_000_000) < 1_000_000_000
    run(collect(disp))
    assert TransferHandle.from_params(d.decode_calls[0].handle).address == "10.0.0.7:5000"


class NothingHeld:
    def matched_blocks(self, instance, hashes):
        return 0

    def clears(self, instance):
        return 0

    def holds(self, instance, block):
        return False

    def stale(self, instance):
        return False


def test_a_promise_stands_for_a_good_prefill_and_is_withdrawn_when_p_fails_or_the_client_leaves(cancelled):
    from pdcluster.router.pending_blocks import PendingBlocks

    prompt = list(range(1, 22))  # 5 full blocks of 4, hittable
    ok_p, bad_p, hung_p = FakeEngine(), FakeEngine(prefill_outcome=DIED), FakeEngine(prefill_outcome=HANG)

    def dispatcher(p):
        pending = PendingBlocks()
        return make([p], [FakeEngine()], policy="prefix_aware", block_size=4, lookup=NothingHeld(),
                    pending=pending), pending

    disp, pending = dispatcher(ok_p)
    run(collect(disp))
    assert pending.counts("prefill-0").requests == 1  # P finished: its promise waits for the events
    disp, pending = dispatcher(bad_p)
    run(expect_error(disp))
    assert pending.counts("prefill-0").requests == 0 and pending.counts("prefill-0").withdrawn == 1

    async def leave_early(disp):
        gen = disp.generate("r-gone", prompt, SAMPLING)
        task = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.05)  # P is prefilling (it never answers)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await gen.aclose()

    disp, pending = dispatcher(hung_p)
    run(leave_early(disp))
    assert pending.counts("prefill-0").requests == 0 and pending.counts("prefill-0").withdrawn == 1
    pending.check_integrity()


class AllHeld(NothingHeld):
    """Every instance holds every block."""

    def matched_blocks(self, instance, hashes):
        return len(hashes)


def local_dispatcher(p: FakeEngine, d: FakeEngine, **kw) -> PDDispatcher:
    from pdcluster.proto.router_spec import LocalPrefillSpec

    return make([p], [d], policy="prefix_aware", block_size=4, lookup=AllHeld(),
                local=LocalPrefillSpec(policy="short_remainder", max_tokens=2), **kw)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_short_remainder_is_served_by_d_alone_and_usage_says_so(cancelled, mode):
    p = FakeEngine()
    d = FakeEngine(decode_script=[DecodeDelta([10]), DecodeDelta([11], finish_reason="length", num_cached_tokens=4)])
    records = []
    disp = local_dispatcher(p, d, mode=mode, sinks=[records.append])
    chunks = run(collect(disp, "r-local"))
    assert p.prefill_calls == []  # P never sees it
    (dreq,) = d.decode_calls
    assert dreq.handle is None and dreq.prompt_token_ids == PROMPT
    last = chunks[-1]
    assert (last.local_prefill, last.prefill_instance, last.d_cached_tokens, last.p_cached_tokens,
            last.transferred_tokens) == (True, "decode-0", 4, 0, 0)
    (rec,) = records
    assert rec.local_prefill and rec.prefill_reason == "short_remainder" and rec.prefill_instance is None
    assert rec.d_cached_tokens == 4 and rec.predicted_p_hit_tokens is None
    assert disp.picker.in_flight() == {"prefill-0": 0, "decode-0": 0} and disp.picker._load["decode-0"].local == 0


def test_d_s_local_slot_frees_at_the_first_token(cancelled):
    p, d = FakeEngine(), FakeEngine(decode_script=[DecodeDelta([10]), HANG])
    disp = local_dispatcher(p, d, timeout=0.3)

    async def main():
        first = disp.generate("r1", PROMPT, SAMPLING)
        assert (await first.__anext__()).new_token_ids == [10]
        assert disp.picker._load["decode-0"].local == 0  # decoding now: the slot is free
        await first.aclose()

    run(main())
    assert p.prefill_calls == []


def test_a_failed_local_prefill_is_an_error_naming_d_and_nothing_stays_counted(cancelled):
    p = FakeEngine()
    d = FakeEngine(decode_script=[DecodeDelta([], finish_reason="error")])
    disp = local_dispatcher(p, d)
    err, _ = run(expect_error(disp))
    assert err.status == 502 and "decode-0" in str(err) and "D's own prefill" in str(err)
    dead = local_dispatcher(FakeEngine(), FakeEngine(decode_script=[DIED]))
    err, _ = run(expect_error(dead))
    assert err.status == 503 and "decode-0" in str(err)
    for disp_ in (disp, dead):
        assert disp_.picker._load["decode-0"].local == 0 and disp_.picker.in_flight()["decode-0"] == 0
