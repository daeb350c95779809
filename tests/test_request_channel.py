"""The router <-> engine request channel (transfer/request_channel.py), over real TCP
connections in one process: a `LocalActor` stands for the Ray actor handle, running an engine body's
methods in the same event loop, and can die and restart as Ray's actors do."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
from channel_fakes import SAMPLING, SECRET, Body, LocalActor, connected, decode_req, items, prefill_req

from pdcluster.proto.messages import DecodeRequest, PoolOffer, PoolRequest, PrefillRequest, PrefillResult
from pdcluster.transfer.request_channel import (
    EngineCallFailed,
    EngineChannel,
    EngineUnavailable,
)


def test_prefill_and_decode_round_trip():
    async def main():
        actor, ch = await connected(Body())
        pre = await asyncio.wait_for(ch.call("prefill", prefill_req()).next(), 5)
        deltas = await items(ch.call("decode", decode_req()))
        ch.close()
        return pre, deltas

    pre, deltas = asyncio.run(main())
    assert pre == PrefillResult("r0", None, 3, p_cached_tokens=2)
    assert [d.new_token_ids for d in deltas] == [[100], [101], [102]]
    assert [d.finish_reason for d in deltas] == [None, None, "length"]


def test_a_pool_offer_round_trips_and_its_failure_names_itself():
    async def main():
        _, ch = await connected(Body())
        offer = await asyncio.wait_for(ch.call("open_pool", PoolRequest("t1", list(range(10)))).next(), 5)
        ch.close()
        _, failing = await connected(Body(fail=True))
        with pytest.raises(EngineCallFailed, match="ValueError: no tier for t2"):
            await asyncio.wait_for(failing.call("open_pool", PoolRequest("t2", [1])).next(), 5)
        failing.close()
        return offer

    assert asyncio.run(main()) == PoolOffer("t1", 5)


def test_replies_of_one_loop_turn_share_a_frame():
    async def main():
        actor, ch = await connected(Body())
        results = await asyncio.gather(*(items(ch.call("decode", decode_req(f"r{i}"))) for i in range(20)))
        [conn] = actor.body._channel.connections
        ch.close()
        return results, conn.frames_sent, conn.messages_sent

    results, frames, replies = asyncio.run(main())
    assert all([d.new_token_ids for d in r] == [[100], [101], [102]] for r in results)
    assert replies == 60 and frames < replies / 4, (frames, replies)


def test_cancel_aborts_the_call_in_the_engine():
    async def main():
        actor, ch = await connected(Body(hang_after_first=True))
        call = ch.call("decode", decode_req("gone"))
        first = await asyncio.wait_for(call.next(), 5)
        call.cancel()
        for _ in range(100):
            if actor.body.cancelled:
                break
            await asyncio.sleep(0.01)
        in_flight = actor.body._channel.calls_in_flight
        ch.close()
        return first, actor.body.cancelled, in_flight

    first, cancelled, in_flight = asyncio.run(main())
    assert first.new_token_ids == [100]
    assert cancelled == ["gone"] and in_flight == 0


def test_an_engine_error_reaches_the_caller_with_its_message():
    async def main():
        actor, ch = await connected(Body(fail=True))
        with pytest.raises(EngineCallFailed, match="ValueError: bad prompt for r7"):
            await asyncio.wait_for(ch.call("prefill", prefill_req("r7")).next(), 5)
        ch.close()

    asyncio.run(main())


def test_a_decode_that_ends_without_a_finish_ends_in_none():
    async def main():
        actor, ch = await connected(Body(finish=False))
        call = ch.call("decode", decode_req())
        got = [await asyncio.wait_for(call.next(), 5) for _ in range(4)]
        ch.close()
        return got, call.done

    got, done = asyncio.run(main())
    assert [d.new_token_ids for d in got[:3]] == [[100], [101], [102]] and got[3] is None and done


def test_a_dead_engine_fails_its_calls_then_the_channel_reopens_on_the_restarted_one():
    async def main():
        actor, ch = await connected(Body(hang_after_first=True))
        call = ch.call("decode", decode_req("in-flight"))
        await asyncio.wait_for(call.next(), 5)
        old_address = ch.address
        actor.die(restart_as=Body())
        # Ray's word or the closed connection, whichever the channel hears first.
        with pytest.raises(EngineUnavailable, match="ActorDiedError|connection closed"):
            await asyncio.wait_for(call.next(), 5)
        with pytest.raises(EngineUnavailable):  # down: refused at once, not queued
            ch.call("prefill", prefill_req())
        for _ in range(200):
            if ch.connected:
                break
            await asyncio.sleep(0.01)
        assert ch.connected and ch.address != old_address
        pre = await asyncio.wait_for(ch.call("prefill", prefill_req("after")).next(), 5)
        ch.close()
        return pre

    assert asyncio.run(main()).request_id == "after"


def test_before_up_runs_on_every_connection_before_calls_and_a_failure_keeps_it_down():
    """The router refreshes what it knows of the instance there (it may have moved); until that
    succeeds the channel takes no call, and the reconnect loop keeps trying."""
    refreshes: list[bool] = []
    fail_next = [False]

    async def main():
        actor = LocalActor(Body(hang_after_first=True))
        ch = EngineChannel("decode-0", actor, SECRET, before_up=None)

        async def before_up():
            refreshes.append(ch.connected)  # never up yet while it runs
            if fail_next[0]:
                fail_next[0] = False
                raise RuntimeError("the refresh failed")
        ch._before_up = before_up
        await ch.connect()
        fail_next[0] = True
        actor.die(restart_as=Body())
        for _ in range(100):
            if not ch.connected:
                break
            await asyncio.sleep(0.01)
        down_s = time.monotonic()
        for _ in range(500):  # the first reopen's refresh fails; the next one, a second later, works
            if ch.connected:
                break
            await asyncio.sleep(0.01)
        up = ch.connected and time.monotonic() - down_s > 0.9
        pre = await asyncio.wait_for(ch.call("prefill", prefill_req("after")).next(), 5)
        ch.close()
        return up, pre

    up, pre = asyncio.run(main())
    assert up and pre.request_id == "after" and refreshes == [False, False, False]


def test_a_lost_connection_fails_calls_before_ray_says_the_actor_died():
    async def main():
        actor, ch = await connected(Body(hang_after_first=True))
        call = ch.call("decode", decode_req("in-flight"))
        await asyncio.wait_for(call.next(), 5)
        for conn in actor.body._channel.connections:  # the process is gone; Ray's channel_closed call still pending
            conn.close()
        with pytest.raises(EngineUnavailable, match="connection closed"):
            await asyncio.wait_for(call.next(), 5)
        assert not actor._pending[-1].done()  # not Ray's word: the watch call is still waiting
        ch.close()

    asyncio.run(main())


def test_a_closed_channel_refuses_calls_and_fails_waiting_ones():
    async def main():
        actor, ch = await connected(Body(hang_after_first=True))
        call = ch.call("decode", decode_req())
        await asyncio.wait_for(call.next(), 5)
        ch.close()
        with pytest.raises(EngineUnavailable, match="the router closed the channel"):
            await asyncio.wait_for(call.next(), 5)
        with pytest.raises(EngineUnavailable):
            ch.call("prefill", prefill_req())
        actor.body._channel.close()

    asyncio.run(main())


def test_a_prompt_of_128k_ids_crosses_in_pieces_and_arrives_whole():
    class Echo(Body):
        async def prefill(self, req: PrefillRequest) -> PrefillResult:
            return PrefillResult(req.request_id, {"ids": req.prompt_token_ids}, len(req.prompt_token_ids), 0)

    async def main():
        actor, ch = await connected(Echo())
        prompt = list(range(131072))
        calls = [ch.call("prefill", PrefillRequest(f"big-{i}", prompt[i:], SAMPLING)) for i in range(3)]
        results = [await asyncio.wait_for(c.next(), 10) for c in calls]
        ch.close()
        return prompt, results

    prompt, results = asyncio.run(main())
    assert [r.connector_params["ids"] for r in results] == [prompt[i:] for i in range(3)]


def test_two_routers_on_one_engine_each_get_their_own_replies():
    async def main():
        actor, first = await connected(Body())
        second = await EngineChannel("decode-0", actor, SECRET).connect()  # its call ids start at 0 too
        a, b = await asyncio.gather(items(first.call("decode", decode_req("a", 2))),
                                    items(second.call("decode", decode_req("b", 4))))
        first.close()
        second.close()
        return a, b

    a, b = asyncio.run(main())
    assert [d.new_token_ids for d in a] == [[100], [101]]
    assert [d.new_token_ids for d in b] == [[100], [101], [102], [103]]


def test_a_router_gone_aborts_its_calls_in_the_engine():
    async def main():
        actor, ch = await connected(Body(hang_after_first=True))
        call = ch.call("decode", decode_req("orphan"))
        await asyncio.wait_for(call.next(), 5)
        ch.close()  # as the router's process exiting would: the connection closes, no Abort sent
        for _ in range(100):
            if actor.body.cancelled:
                break
            await asyncio.sleep(0.01)
        server = actor.body._channel
        return actor.body.cancelled, server.calls_in_flight, len(server.connections)

    assert asyncio.run(main()) == (["orphan"], 0, 0)


def test_an_engine_whose_port_refuses_fails_the_connect_naming_it():
    import socket

    class Gone(Body):
        async def open_channel(self) -> str:
            with socket.socket() as s:  # a port nothing listens on once this closes
                s.bind(("127.0.0.1", 0))
                return f"127.0.0.1:{s.getsockname()[1]}"

    async def main():
        await EngineChannel("prefill-3", LocalActor(Gone()), SECRET).connect()

    with pytest.raises(EngineUnavailable, match=r"cannot connect to prefill-3's request channel at 127\.0\.0\.1:\d+"):
        asyncio.run(main())


def test_the_handle_crosses_typed_and_a_malformed_one_is_refused_at_the_wire():
    from pdcluster.proto.handle import TransferHandle
    from pdcluster.transfer.channel_wire import ENGINE_INBOX, DecodeCall, _encode

    handle = TransferHandle("e-p0", "10.0.0.1:18600", "r0-0", 3, "torch_dist")
    call = DecodeCall(7, DecodeRequest("r0", [1, 2, 3], SAMPLING, handle))
    [back] = ENGINE_INBOX.decode(_encode([call]))
    assert back == call and isinstance(back.request.handle, TransferHandle)
    # What a peer could send instead: a handle with no port, one of an unknown transport.
    for bad in ({"address": "nowhere"}, {"transport": "carrier-pigeon"}):
        raw = msgspec.msgpack.decode(_encode([call]))
        raw[0][2]["handle"].update(bad)
        with pytest.raises(msgspec.ValidationError):
            ENGINE_INBOX.decode(msgspec.msgpack.encode(raw))


def test_logprobs_cross_the_wire_exactly_minus_infinity_included():
    from pdcluster.proto.messages import DecodeDelta, TokenLogprobs
    from pdcluster.transfer.channel_wire import ROUTER_INBOX, DecodeReply, PrefillReply, _encode

    lps = (TokenLogprobs((5, 6), (-0.25, float("-inf")), (1, 2)),)
    delta = DecodeDelta([5], logprobs=lps, prompt_logprobs=(None, *lps))
    pre = PrefillResult("r0", None, 3, 0, prompt_logprobs=(None, *lps))
    assert ROUTER_INBOX.decode(_encode([DecodeReply(1, delta, False), PrefillReply(2, pre, True)])) == \
        [DecodeReply(1, delta, False), PrefillReply(2, pre, True)]
