"""The simulated engine's actor bodies in one process, without Ray: a P and a D talking over
the real gRPC transfer, their caches, the bytes that moved, the check of those bytes, and
the KV events on the wire."""

from __future__ import annotations

import asyncio
import random
from contextlib import asynccontextmanager

import msgspec
import pytest
import zmq
from dispatch_fakes import until
from e2e import free_port, free_port_run, settled, tiny_model_dir
from vllm.distributed.kv_events import BlockStored, KVEventBatch

from pdcluster.cluster.sim.engine import SimEngineActor
from pdcluster.proto.handle import TransferHandle
from pdcluster.proto.messages import DecodeRequest, PrefillRequest, SamplingSpec
from pdcluster.proto.spec import parse_spec
from pdcluster.transfer.auth import curve_keys, zmq_secure_client
from pdcluster.transfer.sources import TransferIdInUse

BLOCK = 128


def sim_spec(params: str = "qwen3-0.6b-1dev", kv_blocks: int = 128, **transfer):
    return settled(parse_spec({
        "name": "sim-unit", "model": {"path": tiny_model_dir()},
        "engine": {"kind": "sim", "block_size": BLOCK, "max_model_len": 16384, "max_num_batched_tokens": 1024,
                   "max_num_seqs": 8},
        "sim": {"params": params, "kv_blocks": kv_blocks},
        "transfer": {"base_port": free_port(), "timeout_s": 10, "chunk_bytes": 4096, **transfer},
        "router": {"port": free_port(), "kv_events_port": free_port_run(4)}}))


@asynccontextmanager
async def p_and_d(spec):
    p, d = SimEngineActor(spec, "prefill", 0), SimEngineActor(spec, "decode", 0)
    try:
        yield p, d
    finally:
        p.shutdown()
        d.shutdown()


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


async def serve(p, d, tokens: list[int], rid: str, push: bool = True, max_tokens: int = 8, final_only: bool = False):
    """Push (D asks while P computes) or pull (D after P's answer): P's result and D's deltas."""
    s = SamplingSpec(max_tokens=max_tokens, ignore_eos=True, final_only=final_only)

    async def decode(handle):
        return [delta async for delta in d.decode(DecodeRequest(rid, tokens, s, handle))]

    handle = TransferHandle(p.engine_id, p.kv_address, rid, len(tokens))  # as the router names it
    if push:
        deltas = asyncio.ensure_future(decode(handle))
        # D is asking before P starts, as when the router sends both at once.
        await until(lambda: p.producer.sources.waiting or deltas.done(), 10, what="D asking P")
        assert not deltas.done(), "D ended before it asked P"
        pre = await p.prefill(PrefillRequest(rid, tokens, s, transfer_id=rid))
        return pre, await deltas
    pre = await p.prefill(PrefillRequest(rid, tokens, s, transfer_id=rid))
    return pre, await decode(handle)


async def all_free(*engines, timeout: float = 5):
    for _ in range(int(timeout / 0.05)):
        if all(e.check_blocks()["held"] == 0 for e in engines):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"blocks still held: {[e.check_blocks() for e in engines]}")


def test_cold_then_warm_push_hits_on_both_sides_and_moves_only_the_rest():
    async def run():
        async with p_and_d(sim_spec()) as (p, d):
            family = prompt(1, 3000)
            pre, deltas = await serve(p, d, family, "cold")
            t = deltas[-1].transfer
            assert pre.p_cached_tokens == 0 and (t.d_cached_tokens, t.transferred_tokens) == (0, 3000)
            assert t.blocks_per_group == (24,) and t.error is None
            assert t.transfer_start_ns <= t.transfer_end_ns <= t.kv_ready_ns <= deltas[-1].engine.scheduled_ns
            pre, deltas = await serve(p, d, family[:2900] + prompt(2, 60), "warm")
            t = deltas[-1].transfer
            assert pre.p_cached_tokens == 22 * BLOCK and t.d_cached_tokens == 22 * BLOCK
            assert t.transferred_tokens == 2960 - 22 * BLOCK and t.blocks_per_group == (2,)
            row = d.sim_stats().payload_bytes_per_block["full_kv"]
            assert d.sim_stats().received_bytes == (24 + 2) * row
            assert sum(len(x.new_token_ids) for x in deltas) == 8 and deltas[-1].finish_reason == "length"
            await all_free(p, d)
    asyncio.run(run())


def test_final_only_sends_every_token_in_one_delta_with_its_time():
    async def run():
        async with p_and_d(sim_spec()) as (p, d):
            tokens = prompt(4, 300)
            _, streamed = await serve(p, d, tokens, "streamed", push=False, max_tokens=12)
            _, [final] = await serve(p, d, tokens, "final", push=False, max_tokens=12, final_only=True)
            assert len(streamed) >= 2  # the first token goes at once
            ids = [t for x in streamed for t in x.new_token_ids]  # the same prompt samples the same ids
            assert final.finish_reason == "length" and final.new_token_ids == ids and len(ids) == 12
            assert len(final.token_ns) == 12 and list(final.token_ns) == sorted(final.token_ns)
            assert final.token_ns[0] < final.token_ns[-1]  # each token at its own step's time
            await all_free(p, d)
    asyncio.run(run())


@pytest.mark.parametrize("push", [False, True])
def test_multi_component_state_moves_per_component_as_the_cost_model_plans(push):
    async def run():
        async with p_and_d(sim_spec("dsv4-flash-910c", kv_blocks=64)) as (p, d):
            # Chunks of 1,024 tokens: the window's first tail block (15) is done with the second
            # chunk, so in push mode D reads it before the prompt ends.
            tokens = prompt(3, 2148)
            _, deltas = await serve(p, d, tokens, "v4", push=push)
            t = deltas[-1].transfer
            plan = d.cost.blocks_to_send(2148, 0)
            comps = d.cost.components
            assert t.error is None and t.blocks_per_group == tuple(plan[c.name] for c in comps)
            assert t.bytes_per_group == tuple(plan[c.name] * c.bytes_per_block for c in comps)
            rows = d.sim_stats().payload_bytes_per_block
            assert d.sim_stats().received_bytes == sum(plan[c.name] * rows[c.name] for c in comps)
            # The modelled transfer of the full-size bytes is waited out, however fast the scaled ones went.
            assert t.transfer_end_ns - t.transfer_start_ns >= d.cost.transfer_s(sum(t.bytes_per_group)) * 1e9 * 0.99
            await all_free(p, d)
    asyncio.run(run())


def test_d_rejects_bytes_that_do_not_match_the_prompt():
    async def run():
        async with p_and_d(sim_spec()) as (p, d):
            tokens = prompt(4, 1000)
            await p.prefill(PrefillRequest("bad", tokens, SamplingSpec(max_tokens=4), transfer_id="bad"))
            p.producer.kv.view("full_kv").zero_()  # P's blocks lose their content
            handle = TransferHandle(p.engine_id, p.kv_address, "bad", len(tokens))
            deltas = [x async for x in d.decode(DecodeRequest("bad", tokens, SamplingSpec(max_tokens=4), handle))]
            assert deltas[-1].finish_reason == "error"
            assert "does not match the prompt" in deltas[-1].transfer.error
            await all_free(p, d)
    asyncio.run(run())


def test_kv_events_go_out_in_vllms_wire_format():
    async def run():
        spec = sim_spec()
        async with p_and_d(spec) as (p, d):
            pub, _ = spec.kv_event_ports("prefill", 0)

            def subscriber(keys):
                sub = zmq.Context.instance().socket(zmq.SUB)
                if keys is not None:
                    zmq_secure_client(sub, keys)
                sub.connect(f"tcp://127.0.0.1:{pub}")
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                return sub

            sub, plain = subscriber(curve_keys(spec.secret())), subscriber(None)  # only the cluster's is served
            await asyncio.sleep(0.3)  # a SUB misses what is published before it joined
            await serve(p, d, prompt(5, 1000), "ev")
            assert await asyncio.to_thread(sub.poll, 10_000), "the cluster's subscriber got no KV events"
            topic, seq, payload = sub.recv_multipart()
            assert not plain.poll(200), "a subscriber without the cluster's keys got KV events"
            sub.close(linger=0)
            plain.close(linger=0)
            batch = msgspec.msgpack.Decoder(KVEventBatch).decode(payload)
            stored = [e for e in batch.events if isinstance(e, BlockStored)]
            assert int.from_bytes(seq, "big") == 0
            assert sum(len(e.block_hashes) for e in stored) == 1000 // BLOCK
            assert stored[0].parent_block_hash is None and stored[0].token_ids == prompt(5, 1000)[:len(
                stored[0].block_hashes) * BLOCK]
    asyncio.run(run())


def test_bad_requests_fail_with_a_clear_error():
    async def run():
        async with p_and_d(sim_spec()) as (p, d):
            with pytest.raises(ValueError, match="max_model_len"):
                await p.prefill(PrefillRequest("long", prompt(6, 16384), SamplingSpec()))
            handle = TransferHandle(p.engine_id, p.kv_address, "x", 30)  # (fewer: the pool's first blocks)
            with pytest.raises(ValueError, match="the handle covers 30 tokens, the prompt has 20"):
                [x async for x in d.decode(DecodeRequest("x", prompt(7, 20), SamplingSpec(), handle))]
            await all_free(p, d)
    asyncio.run(run())


def test_a_transfer_id_in_use_fails_that_prefill_and_p_serves_on():
    """Issue 26: two prefills naming one transfer (two routers that counted alike, before ids were
    the router's own) hit an assert in P's step; now the second is refused, the first served."""
    async def run():
        async with p_and_d(sim_spec(lease_s=1)) as (p, d):  # no D reads t: its lease frees it
            s = SamplingSpec(max_tokens=1)
            first = asyncio.ensure_future(p.prefill(PrefillRequest("a", prompt(8, 2000), s, transfer_id="t")))
            await until(lambda: "t" in p.producer.sources._sources or first.done(), 10, what="P computing t")
            with pytest.raises(TransferIdInUse, match="'t' is in use"):
                await p.prefill(PrefillRequest("b", prompt(9, 2000), s, transfer_id="t"))
            assert (await first).prompt_tokens == 2000
            pre, deltas = await serve(p, d, prompt(10, 500), "after")
            assert deltas[-1].finish_reason == "length"
            await all_free(p, d)
    asyncio.run(run())


@pytest.mark.parametrize("on_failure", ["error", "recompute"])
def test_a_transfer_broken_halfway_errors_or_is_recomputed_and_frees_its_blocks(on_failure):
    async def run():
        spec = sim_spec(on_failure=on_failure, break_transfers_with_prefix="broken-")
        async with p_and_d(spec) as (p, d):
            tokens = prompt(8, 1000)
            _, deltas = await serve(p, d, tokens, "broken-1")
            t = deltas[-1].transfer
            assert t.error == "KV pull from P failed" and (t.d_cached_tokens, t.transferred_tokens) == (0, 0)
            if on_failure == "error":
                assert deltas[-1].finish_reason == "error"
            else:  # D computed the prompt itself: the same tokens as a healthy transfer gives
                _, healthy = await serve(p, d, tokens, "healthy")
                assert deltas[-1].finish_reason == "length"
                assert [t for x in deltas for t in x.new_token_ids] == [t for x in healthy for t in x.new_token_ids]
            await all_free(p, d)
    asyncio.run(run())
