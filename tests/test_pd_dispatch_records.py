"""The dispatcher (router/pd_dispatch.py) over fake engines: what it records and counts. Token times
from batched deltas, predicted hits and the picker's counts, instances restarted elsewhere, promised
blocks, and requests D prefills alone."""

from __future__ import annotations

import asyncio
import time

import pytest
from dispatch_fakes import (
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
    until,
)

from pdcluster.proto.messages import (
    DecodeDelta,
    TokenLogprobs,
    TransferStats,
)
from pdcluster.router.pd_dispatch import PDDispatcher


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
    assert (chunk.pd.d_cached_tokens, chunk.pd.transferred_tokens) == (2, 3)


def test_merging_deltas_keeps_times_only_when_every_token_has_one():
    a, b = DecodeDelta([1], token_ns=(5,)), DecodeDelta([2, 3], token_ns=(6, 7))
    assert a.then(b) == DecodeDelta([1, 2, 3], token_ns=(5, 6, 7))
    assert a.then(DecodeDelta([2])).token_ns == ()  # the router stamps them all on arrival
    assert DecodeDelta([]).then(b) == b
    fin = DecodeDelta([4], finish_reason="stop", transfer=TransferStats(transferred_tokens=9), token_ns=(8,))
    assert a.then(fin) == DecodeDelta([1, 4], "stop", TransferStats(transferred_tokens=9), token_ns=(5, 8))
    with pytest.raises(AssertionError, match="ends its choice"):
        fin.then(a)


def test_merging_keeps_every_tokens_logprobs_and_never_mixes_choices():
    lp = [TokenLogprobs((t,), (-0.5,)) for t in (1, 2)]
    a, b = DecodeDelta([1], logprobs=(lp[0],)), DecodeDelta([2], logprobs=(lp[1],))
    assert a.then(b).logprobs == tuple(lp)
    other, ended = DecodeDelta([9], index=1), DecodeDelta([3], index=0, choice_finish="length")
    assert not a.joins(other) and not ended.joins(b) and a.joins(ended)


def test_a_delta_of_another_choice_waits_for_the_next_read():
    class Stream:  # a PendingCall whose replies are all here
        def __init__(self, items):
            self.items, self.back = list(items), None

        @property
        def has_reply(self):
            return self.back is not None or bool(self.items)

        async def next(self):
            if self.back is not None:
                item, self.back = self.back, None
                return item
            return self.items.pop(0) if self.items else None

        def push_back(self, item):
            self.back = item

    stream = Stream([DecodeDelta([1]), DecodeDelta([2]), DecodeDelta([9], index=1), DecodeDelta([3], "stop")])
    got = [run(PDDispatcher._next_delta(stream)) for _ in range(3)]
    assert [(d.index, d.new_token_ids) for d in got] == [(0, [1, 2]), (1, [9]), (0, [3])]


def test_prefix_aware_records_predictions_and_frees_its_counts(cancelled):
    class HoldsFirstBlock:
        def matched_blocks(self, instance, hashes):
            return 1 if instance == "prefill-1" else 0

        def tier_matched_blocks(self, instance, hashes, start):
            return 0

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
    assert d.decode_calls[0].handle.address == "10.0.0.7:5000"


class NothingHeld:
    def matched_blocks(self, instance, hashes):
        return 0

    def tier_matched_blocks(self, instance, hashes, start):
        return 0

    def clears(self, instance):
        return 0

    def holds(self, instance, block):
        return False

    def removals(self, instance):
        return 0

    def removed_since(self, instance, block, removals):
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
        await until(lambda: hung_p.prefill_pending, what="P's prefill call")  # it never answers
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
    last = chunks[-1].pd
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
