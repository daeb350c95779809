"""End to end on real engines: P's host KV tier (issue 29; transfer/tier_scheduler.py).

The shared bf16 P1D1 (tests/e2e.py p1d1_bf16_spec) gives P and D each a device pool of 69 usable
blocks and a host tier. Four 3,000-token families through the router, one after another, push
the first out of the device caches; when it comes again, P loads its blocks from its tier instead
of computing them, D loads them from its own instead of pulling them, and the tokens equal a
single engine's.
"""

from __future__ import annotations

import random

import httpx
import pytest
import ray
from e2e import (
    FAULT_PREFIX,
    P1_BLOCKS,
    assert_no_kv_in_use,
    complete,
    local_prefill_as,
    p1d1_bf16_spec,
    reset_caches,
    shared_cluster,
    shared_reference,
    wait_until,
)

from pdcluster.proto.handle import TransferHandle
from pdcluster.proto.messages import DecodeRequest, PoolOffer, PoolRequest, PrefillRequest, SamplingSpec
from pdcluster.router.attribution import attribute
from pdcluster.router.run_store import load_run
from pdcluster.router.timeline_views import format_summary, format_waterfall, summarize

# One bf16 P1D1 with test_e2e_local_prefill and test_e2e_recompute, which run first.
pytestmark = [pytest.mark.e2e, pytest.mark.local_ray, pytest.mark.shared_cluster("p1d1-bf16")]
PROMPT = 3000  # 24 blocks of 128; 23 full ones can hit
FULL = (PROMPT - 1) // 128 * 128  # vLLM computes a prompt's last token at least: 2,944 tokens can hit


@pytest.fixture(scope="module")
def cluster():
    return shared_cluster("p1d1-bf16", p1d1_bf16_spec)


@pytest.fixture(scope="module")
def reference(cluster):
    return shared_reference("bfloat16")  # test_e2e_local_prefill's


def family(name: str) -> list[int]:
    rng = random.Random(f"tier-{name}")
    return [rng.randrange(3, 1000) for _ in range(PROMPT)]


def run(cluster, prompt, **extra):
    r = complete(cluster.url, prompt, 16, **extra)
    assert r.status_code == 200, r.text
    body = r.json()
    rec = load_run(cluster.run_dir).record(body["id"])
    return body["choices"][0]["token_ids"], body["usage"]["pd"], rec


def p_prefill_ns(rec) -> int:
    return rec.events["p_done"] - rec.events["p_scheduled"]


def metric(cluster, series: str) -> float:
    """One series' value on the router's /metrics."""
    lines = httpx.get(f"{cluster.url}/metrics", timeout=10).text.splitlines()
    return float(next(ln for ln in lines if ln.startswith(series + " ")).removeprefix(series + " "))


def tier_hits(cluster) -> float:
    """The router's count of prompt tokens P's host tier gave."""
    return metric(cluster, 'pdc_tier_hit_tokens_total{side="prefill",tier="host"}')


def reset_d(cluster) -> None:
    """D forgets what it holds, so that the next request's prompt comes from P whole."""
    d = cluster.decode[0].actor
    assert ray.get(d.reset_prefix_cache.remote())


def test_a_prompt_the_device_cache_dropped_comes_back_from_ps_host_tier(cluster, reference):
    assert 3 * (PROMPT // 128 + 1) > P1_BLOCKS - 1, "three other families must fill P's device pool"
    a = family("a")
    cold_tokens, pd, cold = run(cluster, a)
    assert (pd["p_cached_tokens"], cold.p_tier_tokens) == (0, 0)
    for name in "bce":  # each needs 24 blocks: by the third, every block of a's was taken
        run(cluster, family(name))
    assert_no_kv_in_use(cluster)
    reset_d(cluster)

    hits_before = tier_hits(cluster)  # the router's counter, over the modules sharing the cluster
    cluster.each_router("catch_up_kv_events")  # P's tier announced a's blocks (medium CPU)
    with local_prefill_as(cluster, policy="never"):  # D's index looks full until D's next step
        tokens, pd, again = run(cluster, a)
    assert pd["p_cached_tokens"] == FULL and again.p_tier_tokens == FULL, (pd, again.p_tier_tokens)
    assert pd["transferred_tokens"] == PROMPT  # D pulled all of it from P, the loaded blocks included
    assert again.predicted_p_hit_tokens == FULL  # the router's index: none on P's device, all in its tier
    # P's worker timed the load and the record makes it a part of TTFT of its own (docs/kv_tiers.md).
    parts = attribute(again).parts_ns
    assert 0 < parts["tier_load"] < p_prefill_ns(again), (parts, p_prefill_ns(again))
    assert tokens == cold_tokens == ray.get(reference.greedy.remote(a, 16))
    # Loading 23 blocks is a copy; computing them was the prefill (~16x longer here).
    assert p_prefill_ns(again) < p_prefill_ns(cold) / 2, (p_prefill_ns(again), p_prefill_ns(cold))
    assert_no_kv_in_use(cluster)
    assert tier_hits(cluster) - hits_before == FULL
    assert f"{FULL} from its host tier" in format_summary(summarize(load_run(cluster.run_dir)))


def test_a_prompt_d_lost_comes_back_from_ds_host_tier_and_only_the_rest_comes_from_p(cluster, reference):
    a = family("d-a")
    with local_prefill_as(cluster, policy="never"):  # through P every time: D's part is what is checked
        cold_tokens, pd, _ = run(cluster, a, kv_retention_s=60)  # the hint reaches both tiers (docs/kv_tiers.md)
        for name in ("d-b", "d-c", "d-e"):  # out of D's device cache as out of P's
            run(cluster, family(name))
        tokens, pd, rec = run(cluster, a)
    assert (pd["d_cached_tokens"], rec.d_tier_tokens, pd["transferred_tokens"]) == (FULL, FULL, PROMPT - FULL), (
        pd, rec.d_tier_tokens)
    assert tokens == cold_tokens == ray.get(reference.greedy.remote(a, 16))
    # D's worker timed its load, which ran before it started the pull (docs/kv_tiers.md).
    ev = rec.events
    assert ev["d_tier_load_start"] < ev["d_tier_loaded"] <= ev["transfer_start"], ev
    att = attribute(rec)
    assert att.ttft_ns == sum(att.parts_ns.values()) and "d_tier_load" in att.parts_ns
    assert_no_kv_in_use(cluster)
    assert f"D cached {FULL} ({FULL} from its host tier)" in format_waterfall(load_run(cluster.run_dir), rec.request_id)
    cluster.each_router("catch_up_kv_events")  # the tiers' occupancy, as their events say: every family kept
    for inst in ("prefill-0", "decode-0"):
        assert metric(cluster, f'pdc_tier_blocks{{instance="{inst}",tier="host"}}') >= 4 * (FULL // 128), inst


def test_a_tier_load_that_fails_is_computed_instead_and_the_tokens_stay_exact(cluster, reference):
    """P's tier fails the load (fault injection by request id): vLLM recomputes those blocks
    (the cluster's transfer.on_failure: recompute), D pulls them as usual, nothing leaks."""
    f = family("fault")
    run(cluster, f)
    for name in ("x", "y", "z"):
        run(cluster, family(name))
    reset_d(cluster)
    p, d = cluster.prefill[0].actor, cluster.decode[0].actor
    sampling = SamplingSpec(max_tokens=16, temperature=0, ignore_eos=True)
    pre = ray.get(p.prefill.remote(PrefillRequest(FAULT_PREFIX + "tier", f, sampling, transfer_id="tier-fault")))
    assert (pre.p_cached_tokens, pre.p_tier_tokens) == (0, 0)  # vLLM counted it cached; P computed it
    handle = TransferHandle(cluster.prefill[0].engine_id, cluster.prefill[0].kv_address, "tier-fault", PROMPT)
    deltas = [ray.get(ref) for ref in d.decode.options(num_returns="streaming").remote(
        DecodeRequest("tier-fault-d", f, sampling, handle))]
    assert deltas[-1].transfer.error is None and deltas[-1].transfer.transferred_tokens == PROMPT
    assert [t for delta in deltas for t in delta.new_token_ids] == ray.get(reference.greedy.remote(f, 16))
    assert_no_kv_in_use(cluster)  # P's and D's blocks all back (the tier's lease ended with its order)


def test_d_reads_a_prefix_from_ps_tier_and_p_computes_nothing(cluster, reference):
    """The pool (issue 29 item 2): P offers the run of a prompt's first blocks its tier holds
    (EngineActor.open_pool), D pulls it over the KV plane as it pulls a prefill and computes the
    rest itself; P runs no step."""
    a = family("pool")
    run(cluster, a)
    for name in ("pool-b", "pool-c", "pool-e"):  # out of P's device cache; in its tier
        run(cluster, family(name))
    reset_d(cluster)  # D holds none of it, device or tier
    p, d = cluster.prefill[0], cluster.decode[0]
    steps = ray.get(p.actor.load.remote()).steps
    covered = ray.get(p.actor.open_pool.remote(PoolRequest("pool-1", a))).num_tokens
    assert covered == FULL
    assert ray.get(p.actor.open_pool.remote(PoolRequest("pool-none", family("never-sent")))) == PoolOffer("pool-none", 0)
    sampling = SamplingSpec(max_tokens=16, temperature=0, ignore_eos=True)
    handle = TransferHandle(p.engine_id, p.kv_address, "pool-1", covered)
    deltas = [ray.get(ref) for ref in d.actor.decode.options(num_returns="streaming").remote(
        DecodeRequest("pool-d", a, sampling, handle))]
    last = deltas[-1].transfer
    assert last.error is None and (last.d_cached_tokens, last.transferred_tokens) == (0, FULL), last
    assert [t for delta in deltas for t in delta.new_token_ids] == ray.get(reference.greedy.remote(a, 16))
    assert ray.get(p.actor.load.remote()).steps == steps  # P computed nothing
    assert_no_kv_in_use(cluster)


def test_a_cache_reset_empties_the_tier(cluster):
    a = family("a")
    run(cluster, a)  # in P's device cache and its tier
    reset_caches(cluster)
    _, pd, rec = run(cluster, a)
    assert (pd["p_cached_tokens"], rec.p_tier_tokens) == (0, 0)


def evicted_from_p_and_unknown_to_d(cluster, name: str) -> list[int]:
    """A family P prefilled and then evicted from its device cache (its tier keeps it), and D
    forgot (device and tier), with the router's index caught up on both."""
    a = family(name)
    run(cluster, a)
    for other in ("b", "c", "e"):
        run(cluster, family(f"{name}-{other}"))
    reset_d(cluster)
    run(cluster, family(f"{name}-short")[:100])  # a step of D's (it prefills this alone): its reset announced
    cluster.each_router("catch_up_kv_events")
    return a


def test_the_router_has_d_read_a_family_from_ps_tier_and_compute_only_the_rest(cluster, reference):
    """The pool through the router (router.local_prefill's `pool`): D holds nothing of the family,
    P's tier holds all but its last 56 tokens, under local_prefill.max_tokens: D prefills it
    reading P's tier; P runs no step."""
    a = evicted_from_p_and_unknown_to_d(cluster, "routed-pool")
    steps = ray.get(cluster.prefill[0].actor.load.remote()).steps
    tokens, pd, rec = run(cluster, a)
    assert (rec.local_prefill, rec.pool_instance, rec.predicted_pool_tokens, rec.pool_tokens) == (
        True, "prefill-0", FULL, FULL), rec
    assert (pd["pool_tokens"], pd["d_cached_tokens"], pd["transferred_tokens"]) == (FULL, 0, FULL)
    assert tokens == ray.get(reference.greedy.remote(a, 16))
    assert ray.get(cluster.prefill[0].actor.load.remote()).steps == steps  # P computed nothing
    assert_no_kv_in_use(cluster)
    assert metric(cluster, 'pdc_tier_hit_tokens_total{side="decode",tier="pool"}') >= FULL
    # Each tier as it counts itself (asked of the instances as /metrics is served): P offered the run
    # to D's read, D's tier stored the family's blocks when the request ended.
    p_tier, d_tier = '{instance="prefill-0",tier="host"}', '{instance="decode-0",tier="host"}'
    assert metric(cluster, f"pdc_tier_served_blocks_total{p_tier}") >= FULL // 128
    assert metric(cluster, f"pdc_tier_loaded_blocks_total{p_tier}") >= FULL // 128  # the first test's load
    assert metric(cluster, f"pdc_tier_stored_bytes_total{d_tier}") > 0 and metric(cluster, f"pdc_tier_bytes{d_tier}") > 0
    assert f"({FULL} read from prefill-0's host tier)" in format_waterfall(load_run(cluster.run_dir), rec.request_id)


def test_killing_the_holder_makes_the_next_request_compute_the_family_with_no_error(cluster, reference):
    """Last: it kills P, the family's only holder. The next request of the family is computed, by D
    alone (router.local_prefill's "p_down": no P is up), and nothing fails."""
    a = evicted_from_p_and_unknown_to_d(cluster, "killed-pool")
    ray.kill(cluster.prefill[0].actor, no_restart=False)
    wait_until(lambda: not httpx.get(f"{cluster.url}/health", timeout=10).json()["instances"]["prefill-0"], 30,
               what="the router seeing prefill-0 gone")
    tokens, pd, rec = run(cluster, a)
    assert (rec.error, rec.prefill_reason, rec.pool_instance, rec.pool_tokens) == (None, "p_down", None, 0), rec
    assert (pd["local_prefill"], pd["d_cached_tokens"], pd["pool_tokens"]) == (True, 0, 0)  # computed, all of it
    assert tokens == ray.get(reference.greedy.remote(a, 16))
    d = cluster.decode[0].actor
    wait_until(lambda: ray.get(d.load.remote()).kv_cache_usage == 0.0, 15, what="D's KV usage back to 0")
