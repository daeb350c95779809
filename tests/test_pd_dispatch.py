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
    collect,
    engine_ids,
    expect_error,
    make,
    run,
    until,
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
    assert [r.request_id for r in ps[0].prefill_calls] == engine_ids(disp, 0, 2)
    assert [r.request_id for r in ps[1].prefill_calls] == engine_ids(disp, 1, 3)
    assert [r.request_id for r in ds[0].decode_calls] == engine_ids(disp, 0, 2)
    assert [r.request_id for r in ds[1].decode_calls] == engine_ids(disp, 1, 3)
    assert cancelled == []


def test_chunks_and_decode_request_carry_prefill_results(cancelled):
    p, d = FakeEngine(p_cached=4), FakeEngine()
    disp = make([p], [d])
    chunks = run(collect(disp, "req-x"))

    assert [c.new_token_ids for c in chunks] == [[10], [11, 12], [13]]
    assert [c.finish_reason for c in chunks] == [None, None, "length"]
    assert all(c.pd.p_cached_tokens == 4 for c in chunks)
    last = chunks[-1]
    assert (last.pd.d_cached_tokens, last.pd.transferred_tokens) == (2, 3)
    assert all((c.pd.d_cached_tokens, c.pd.transferred_tokens) == (0, 0) for c in chunks[:-1])

    (preq,) = p.prefill_calls
    [eid] = engine_ids(disp, 0)
    assert preq == PrefillRequest(eid, PROMPT, SAMPLING, transfer_id=eid)
    (dreq,) = d.decode_calls
    assert dreq == DecodeRequest(eid, PROMPT, SAMPLING, TransferHandle("e-p0", "10.0.0.1:5000", eid, len(PROMPT)))
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
        await until(lambda: p.prefill_pending, what="P's prefill call")
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
    [eid] = engine_ids(disp, 0)
    assert dreq.handle == TransferHandle("e-p0", "10.0.0.1:5000", eid, len(PROMPT))
    assert p.prefill_calls[0].transfer_id == eid
    # D's tokens flow before P answers; P never did: the last waits for P until the deadline,
    # then goes without P's hit (D had every layer's KV: the request is whole), and P's call
    # is cancelled.
    assert [c.new_token_ids for c in got] == [[10], [11, 12], [13]] and got[-1].pd.p_cached_tokens == 0
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
    assert chunks[-1].pd.p_cached_tokens == 4 and cancelled == []


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
    ids = [f"pdc-{disp.core.id_prefix}-{n}" for n in (0, 1)]
    assert [r.transfer_id for r in p.prefill_calls] == [r.request_id for r in p.prefill_calls] == ids
    assert [r.handle.transfer_id for r in d.decode_calls] == [r.request_id for r in d.decode_calls] == ids


def test_pull_hands_d_the_router_s_handle_with_its_transport_and_another_connector_s_params(cancelled):
    nixl = {"remote_engine_id": "p", "remote_block_ids": [1, 2]}
    p = FakeEngine(prefill_outcome=PrefillResult("r0", nixl, 5, 0))
    d = FakeEngine()
    disp = make([p], [d])
    disp.transport = "torch_dist"
    run(collect(disp))
    assert d.decode_calls[0].handle == TransferHandle("e-p0", "10.0.0.1:5000", p.prefill_calls[0].transfer_id, 5,
                                                      "torch_dist")
    assert d.decode_calls[0].connector_params == nixl  # what P's connector said, passed on as it is


def test_push_handle_names_the_transport(cancelled):
    p, d = FakeEngine(), FakeEngine()
    disp = make([p], [d], mode="push")
    disp.transport = "torch_dist"
    run(collect(disp))
    assert d.decode_calls[0].handle.transport == "torch_dist"


# -- the pool: D reads a P's tier (router/lifecycle.py's OpenPool)

POOL_PROMPT = list(range(100, 124))  # 6 blocks of 4


def pooled(p_tier: FakeEngine, d: FakeEngine, timeout: float = 5.0) -> PDDispatcher:
    """prefill-1's tier holds the prompt's first 20 tokens; D holds none; D prefills 8 or fewer itself."""
    from test_routing import HeldBlocks

    from pdcluster.proto.router_spec import LocalPrefillSpec

    held = HeldBlocks()
    held.store("prefill-1", POOL_PROMPT[:20], where="tier")
    return make([FakeEngine(), p_tier], [d], timeout=timeout, policy="prefix_aware", block_size=4, lookup=held,
                local=LocalPrefillSpec(policy="short_remainder", max_tokens=8))


async def pool_request(disp: PDDispatcher) -> list:
    return [c async for c in disp.generate("r0", POOL_PROMPT, SAMPLING)]


def test_d_reads_the_prefix_the_holder_offers_and_no_p_prefills_it(cancelled):
    holder, d = FakeEngine(pool_outcome=20), FakeEngine()
    disp = pooled(holder, d)
    got = run(pool_request(disp))
    [offer] = holder.pool_calls
    assert offer.prompt_token_ids == POOL_PROMPT and holder.prefill_calls == []
    assert d.decode_calls[0].handle == TransferHandle("e-p1", "10.0.0.1:5001", offer.transfer_id, 20, "grpc")
    assert got[-1].pd.local_prefill and got[-1].pd.pool_tokens == 3  # what D's (fake) report says it read
    assert cancelled == []


def test_a_holder_lost_as_it_is_asked_leaves_d_computing_the_prompt_with_no_error(cancelled):
    holder, d = FakeEngine(pool_outcome=EngineUnavailable("its connection closed")), FakeEngine()
    got = run(pool_request(pooled(holder, d)))
    assert d.decode_calls[0].handle is None and got[-1].finish_reason == "length"
    # Known to be down: not read at all; the 16 tokens past D's hit go through the other P.
    holder, d = FakeEngine(connected=False), FakeEngine()
    run(pool_request(pooled(holder, d)))
    assert holder.pool_calls == [] and d.decode_calls[0].handle.engine_id == "e-p0"


def test_a_holder_that_never_offers_is_504_and_its_call_is_cancelled(cancelled):
    holder, d = FakeEngine(pool_outcome=HANG), FakeEngine()

    async def main():
        with pytest.raises(Exception) as ei:
            await pool_request(pooled(holder, d, timeout=0.2))
        return ei.value

    err = run(main())
    assert err.status == 504 and "prefill-1's offer" in str(err)
    assert cancelled == holder.pool_pending and d.decode_calls == []
