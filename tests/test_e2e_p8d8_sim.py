"""End to end on deploy/p8d8-sim-tiered.yaml (deploy/p8d8-sim.yaml with small device caches and a
host KV tier on every instance): 8 simulated P and 8 D (DeepSeek-V4-Flash on 910C), a short
C90-shaped load through the router with prefix_aware routing.

Its prompts are a quarter of C90's; the device caches are smaller still: P's holds one prompt (of
the two families each P serves), D's four, so that the 16 families revisited come back from P's
tiers. Every request succeeds with the hits the
workload expects (the structural maximum), the router predicted each side's hit and its tier's part,
no instance holds a block afterwards (and each pool's invariants hold), and every request's
timeline is complete: each event on both causal chains, in order.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import ray
from e2e import assert_no_kv_in_use, free_port, free_port_run, running_cluster

from pdcluster.cluster.replay.run import BenchConfig, run_bench
from pdcluster.proto.spec import load_spec
from pdcluster.proto.spec_sections import RoleKvBlocks
from pdcluster.router.timeline import CAUSAL_CHAINS, OPTIONAL_EVENTS

pytestmark = [pytest.mark.e2e, pytest.mark.local_ray]
DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
PROMPT, SHARED = 32 * 1024 + 4, 29 * 1024  # C90's 90% block-aligned hit, at a quarter of its length
FAMILIES = 16


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    spec = load_spec(DEPLOY / "p8d8-sim-tiered.yaml")
    spec = spec.model_copy(update={
        "name": "e2e-p8d8-sim",
        "sim": spec.sim.model_copy(update={"kv_blocks": RoleKvBlocks(prefill=300, decode=1024)}),
        "transfer": spec.transfer.model_copy(update={"base_port": free_port_run(8)}),
        "router": spec.router.model_copy(update={"port": free_port(), "kv_events_port": free_port_run(32),
                                                 "runs_dir": str(tmp_path_factory.mktemp("runs"))})})
    with running_cluster(spec) as c:
        yield c


@pytest.fixture(scope="module")
def bench(cluster, tmp_path_factory):
    cfg = BenchConfig(base_url=cluster.url, input_len=PROMPT, shared_prefix_ratio=SHARED / PROMPT, output_len=64,
                      num_prefixes=FAMILIES, num_requests=48, max_concurrency=24, request_rate=6.0, progress=False,
                      out=str(tmp_path_factory.mktemp("bench") / "run"))
    return run_bench(cfg, log=lambda m: None)


def test_every_request_succeeds_with_the_expected_hit(bench):
    assert all(r.ok for r in bench.results), [r.error for r in bench.results if not r.ok][:5]
    assert len(bench.results) == 2 * FAMILIES + 48 and all(r.output_tokens == 64 for r in bench.results)
    assert bench.hit_mismatches == []


def test_prefix_aware_routing_predicted_every_hit(bench):
    records = [bench.timelines[r.request_id] for r in bench.results if r.phase in ("check", "formal")]
    assert all(rec.policy == "prefix_aware" for rec in records)
    assert [rec.predicted_p_hit_tokens for rec in records] == [rec.p_cached_tokens for rec in records]
    # All 8 P instances served the load.
    assert len({rec.prefill_instance for rec in records}) == 8


def test_the_tiers_served_hits_and_the_router_predicted_them(cluster, bench):
    formal = [bench.timelines[r.request_id] for r in bench.results if r.phase == "formal"]
    # P's device holds one prompt of its two families: the other comes back from its tier. (Each D
    # keeps the families it serves on its device: routing picks D by its hit too.)
    assert sum(rec.p_tier_tokens for rec in formal) > 0
    for side in ("p", "d"):
        same = [getattr(rec, f"predicted_{side}_tier_tokens") == getattr(rec, f"{side}_tier_tokens") for rec in formal]
        assert sum(same) >= 0.95 * len(formal), (side, sum(same), len(formal))
    # The router's /metrics counts them as the records do (every phase).
    lines = httpx.get(f"{cluster.url}/metrics", timeout=10).text.splitlines()
    series = 'pdc_tier_hit_tokens_total{side="prefill",tier="host"} '
    counted = float(next(ln for ln in lines if ln.startswith(series)).removeprefix(series))
    assert counted == sum(bench.timelines[r.request_id].p_tier_tokens for r in bench.results)
    # And each instance's tier's own count of its loads (pdc_tier_loaded_blocks_total, asked of the
    # instances as the page is served) agrees: P's and D's tier hits are the blocks their tiers loaded.
    loaded = sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.startswith("pdc_tier_loaded_blocks_total{"))
    hits = sum(bench.timelines[r.request_id].p_tier_tokens + bench.timelines[r.request_id].d_tier_tokens
               for r in bench.results)
    assert loaded * cluster.spec.engine.block_size == hits > 0


def test_every_timeline_is_complete(bench):
    for r in bench.results:
        rec = bench.timelines[r.request_id]
        missing = [e for chain in CAUSAL_CHAINS for e in chain if e not in rec.events and e not in OPTIONAL_EVENTS]
        assert not missing, (rec.request_id, missing)
        assert rec.out_of_order() == [], (rec.request_id, rec.out_of_order())
        assert len(rec.token_ns) == rec.output_tokens == 64


def test_a_d_reads_a_prompt_from_a_ps_simulated_tier(cluster, bench):
    """The pool on the real-time simulated engine: the P that prefilled a prompt offers its tier's
    run of it (its payload made from the blocks' keys), and a D that never saw it pulls that run
    and computes the rest; D checks every row it got against the prompt (cluster/sim/consumer.py)."""
    import random

    from e2e import complete

    from pdcluster.proto.handle import TransferHandle
    from pdcluster.proto.messages import DecodeRequest, PoolRequest, SamplingSpec
    from pdcluster.router.run_store import load_run

    prompt = [random.Random(7).randrange(3, 1000) for _ in range(1000)]  # 7 full blocks and a bit
    r = complete(cluster.url, prompt, 4)
    assert r.status_code == 200, r.text
    rec = load_run(cluster.run_dir).record(r.json()["id"])
    p = next(i for i in cluster.prefill if i.name == rec.prefill_instance)
    d = next(i for i in cluster.decode if i.name != rec.decode_instance)
    offer = ray.get(p.actor.open_pool.remote(PoolRequest("sim-pool-1", prompt)))
    assert offer.num_tokens == 7 * 128
    handle = TransferHandle(p.engine_id, p.kv_address, "sim-pool-1", offer.num_tokens)
    deltas = [ray.get(ref) for ref in d.actor.decode.options(num_returns="streaming").remote(
        DecodeRequest("sim-pool-d", prompt, SamplingSpec(max_tokens=4, ignore_eos=True), handle))]
    last = deltas[-1]
    assert last.finish_reason == "length" and last.transfer.error is None, last
    assert (last.transfer.d_cached_tokens, last.transfer.transferred_tokens) == (0, 7 * 128)
    assert sum(len(x.new_token_ids) for x in deltas) == 4


def test_no_block_is_leaked(cluster, bench):
    assert_no_kv_in_use(cluster)
    for inst in cluster.instances:
        blocks = ray.get(inst.actor.check_blocks.remote())  # asserts the pool's invariants
        assert blocks["held"] == 0 and blocks["free"] == blocks["total"], (inst.name, blocks)
