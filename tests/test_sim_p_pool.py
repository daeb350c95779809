"""P from P on the simulated engine. In real time, in one process without Ray (as test_sim_engine):
a P reads the run of a prompt's first blocks a peer P's tier offers (`PrefillRequest.pool`),
computes the rest, and D pulls the whole prompt from it and finds every block's bytes the prompt's.
On the virtual clock, with the router choosing it (router.p_pool): a few families arriving faster
than their holders prefill them spread to idle P's that read the holders' tiers."""

from __future__ import annotations

import asyncio

from test_sim_engine import BLOCK, all_free, prompt, sim_spec
from test_sim_tiered import TIERED

from pdcluster.bench.kv_tier_sim import in_mode
from pdcluster.cluster.replay.run import BenchConfig
from pdcluster.cluster.sim.engine import SimEngineActor
from pdcluster.cluster.sim.virtual.run import simulate
from pdcluster.proto.handle import TransferHandle
from pdcluster.proto.messages import DecodeRequest, PoolRequest, PrefillRequest, SamplingSpec
from pdcluster.proto.spec import load_spec


def test_a_p_reads_a_peers_tier_computes_the_rest_and_d_gets_the_whole_prompt():
    spec = sim_spec("qwen3-8b-h200", kv_blocks=64)
    spec = spec.model_copy(update={
        "prefill": spec.prefill.model_copy(update={"instances": 2}),
        "engine": spec.engine.model_copy(update={"host_tier_gib": 8})})
    s = SamplingSpec(max_tokens=4, ignore_eos=True)

    async def run():
        holder, reader = SimEngineActor(spec, "prefill", 0), SimEngineActor(spec, "prefill", 1)
        d = SimEngineActor(spec, "decode", 0)
        try:
            family = prompt(1, 3000)
            await holder.prefill(PrefillRequest("first", family, s, transfer_id="first"))
            offer = await holder.open_pool(PoolRequest("pool-1", family))
            run_tokens = (len(family) - 1) // BLOCK * BLOCK
            assert offer.num_tokens == run_tokens
            pool = TransferHandle(holder.engine_id, holder.kv_address, offer.transfer_id, offer.num_tokens)
            pre = await reader.prefill(PrefillRequest("again", family, s, transfer_id="again", pool=pool))
            assert (pre.p_pool_tokens, pre.p_cached_tokens) == (run_tokens, run_tokens), pre
            assert pre.p_pool.error is None and pre.p_pool.transferred_tokens == run_tokens
            handle = TransferHandle(reader.engine_id, reader.kv_address, "again", len(family))
            deltas = [x async for x in d.decode(DecodeRequest("again", family, s, handle))]
            t = deltas[-1].transfer
            # D checks every block's rows against the prompt's keys: the read ones came from the holder.
            assert t.error is None and (t.d_cached_tokens, t.transferred_tokens) == (0, len(family)), t
            assert holder.tier.counts().served_blocks == run_tokens // BLOCK
            await all_free(reader, d)
        finally:
            for e in (holder, reader, d):
                e.shutdown()
    asyncio.run(run())


def test_on_the_virtual_clock_few_busy_families_spread_by_reading_their_holders_tiers():
    """4 families on deploy/p8d8-sim-tiered.yaml's P8 at C90's rate: without the read, a family is
    copied to a second P only once its holder's queue is two cold prefills longer; with it, an idle
    P reads the holder's tier over the network and computes only the request's own part."""
    load = BenchConfig.from_preset("c90", num_prefixes=4, num_requests=64)
    spec = load_spec(TIERED)
    bare, read = (simulate(in_mode(spec, mode, 16384), load, vocab_size=1000) for mode in ("tier", "tier+ppool"))
    assert not any(r.pool_tokens for r in bare.records)
    pooled = [r for r in read.records if r.pool_tokens]
    assert pooled and all(r.pool_instance != r.prefill_instance and r.pool_tokens == r.predicted_pool_tokens
                          for r in pooled)
    assert read.hit_mismatches == [] and all(r.ok for r in read.results)
    checked = [r for r in read.records if "-check-" in r.request_id or "-formal-" in r.request_id]
    assert [r.predicted_p_hit_tokens for r in checked] == [r.p_cached_tokens for r in checked]
    assert read.summaries["formal"].stats["TTFT"].avg < bare.summaries["formal"].stats["TTFT"].avg / 2
