"""Routing across 4 simulated P instances (issue 6): prefix_aware keeps each prefix family on
one P after its first request and reaches the structural maximum hit; round_robin does
not; with evictions, the router's index (fed by the engines' KV events) still predicts
every request's hit exactly and holds as many blocks as each engine's cache."""

from __future__ import annotations

import pytest
import ray
from e2e import assert_no_kv_in_use, cluster_spec_for, running_cluster
from routing_checks import Families, prefill_instances_per_family, shuffled_order, structural_max_hit, under_policy

pytestmark = [pytest.mark.e2e, pytest.mark.local_ray]
BLOCK = 128
FAMILIES = Families(count=4, prefix_tokens=8 * BLOCK, suffix_tokens=100)  # 9 blocks a prompt
KV_BLOCKS = 40  # per instance: 4 families of 9 blocks fit one P, 8 do not


@pytest.fixture(scope="module")
def cluster():
    spec = cluster_spec_for(
        "e2e-routing-sim", prefill=4, decode=2,
        engine={"kind": "sim", "max_model_len": 4096, "max_num_batched_tokens": 4096, "max_num_seqs": 8},
        sim={"params": "tiny-qwen3-cpu", "kv_blocks": KV_BLOCKS},  # steps of ~10 ms: the routing is what is checked
        router={"policy": "prefix_aware"})
    with running_cluster(spec) as c:
        yield c


def test_prefix_aware_keeps_each_family_on_one_p(cluster):
    order = shuffled_order(FAMILIES.count, rounds=4, seed=1)
    records = under_policy(cluster, "prefix_aware", FAMILIES, order, "aware")
    per_family = prefill_instances_per_family(records, order)
    assert all(len(set(ps)) == 1 for ps in per_family.values()), per_family
    assert len({ps[0] for ps in per_family.values()}) == FAMILIES.count, f"families share a P: {per_family}"
    assert sum(r.p_cached_tokens for r in records) == structural_max_hit(FAMILIES, order, BLOCK)
    assert [r.predicted_p_hit_tokens for r in records] == [r.p_cached_tokens for r in records]
    assert [r.predicted_d_hit_tokens for r in records] == [r.d_cached_tokens for r in records]
    assert all(r.policy == "prefix_aware" and r.error is None for r in records)


def test_round_robin_scatters_families_and_misses(cluster):
    order = shuffled_order(FAMILIES.count, rounds=4, seed=1)
    records = under_policy(cluster, "round_robin", FAMILIES, order, "rr")
    per_family = prefill_instances_per_family(records, order)
    assert any(len(set(ps)) > 1 for ps in per_family.values()), per_family
    assert sum(r.p_cached_tokens for r in records) < structural_max_hit(FAMILIES, order, BLOCK)
    # Its predictions are still exact: the index does not depend on the policy.
    assert [r.predicted_p_hit_tokens for r in records] == [r.p_cached_tokens for r in records]


def test_after_evictions_the_index_matches_the_caches(cluster):
    many = Families(count=10, prefix_tokens=8 * BLOCK, suffix_tokens=100)  # 90 blocks per round: evictions
    order = shuffled_order(many.count, rounds=3, seed=2)
    records = under_policy(cluster, "round_robin", many, order, "evict")
    assert [r.predicted_p_hit_tokens for r in records] == [r.p_cached_tokens for r in records]
    assert [r.predicted_d_hit_tokens for r in records] == [r.d_cached_tokens for r in records]
    assert any(r.p_cached_tokens for r in records) and not all(r.p_cached_tokens for r in records[many.count:]), (
        "expected both hits and evicted prefixes")
    assert_no_kv_in_use(cluster)
    cluster.each_router("catch_up_kv_events")
    status = ray.get(cluster.router.kv_event_status.remote())
    for inst in cluster.instances:
        engine = ray.get(inst.actor.check_blocks.remote())
        assert status[inst.name].blocks == engine["cached"], (inst.name, status[inst.name], engine)
        assert not status[inst.name].stale and status[inst.name].lost == 0
