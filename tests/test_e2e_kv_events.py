"""End to end on a real P2D2 CPU cluster: the KV-event feed predicts each engine's prefix hit,
and the router's routing by it (issue 6: the routing test on real vLLM engines).

The test process runs its own KvEventFeed on the spec's ports (the engines bind
them, so the router's feed and this one both subscribe). Prompts from a few
prefix families go one at a time through the router (round robin); before
each, the feed predicts every instance's hit; the engines then report theirs
(usage.pd: P's and D's cached tokens), and the run's timelines say which P and
D served it. Each instance's KV pool is a few blocks (num_gpu_blocks_override),
so families evict each other and predictions must follow the evictions too.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from e2e import complete, p2d2_small_pool_spec, run_with, shared_cluster
from routing_checks import Families, prefill_instances_per_family, shuffled_order, structural_max_hit, under_policy

from pdcluster.proto.kv_event_wire import feed_endpoints
from pdcluster.router.kv_events import KvEventFeed
from pdcluster.router.prefix_index import hittable_hashes
from pdcluster.transfer.auth import curve_keys

# One P2D2 (tests/e2e.py p2d2_small_pool_spec: pools of 12 blocks) with test_e2e_migration, which
# runs after this module.
pytestmark = [pytest.mark.e2e, pytest.mark.local_ray, pytest.mark.shared_cluster("p2d2")]

BS = 128
PREFIX_BLOCKS = 3
SUFFIX_TOKENS = 40  # a partial block: each prompt can hit its family's PREFIX_BLOCKS blocks, no more
FAMILIES = 4
# Round robin sends request n to P n%2 and D n%2: every family meets both sides of both
# roles, comes back to an instance that still holds it (hit), or that evicted part of it.
ORDER = [0, 1, 2, 3, 0, 1, 2, 3, 1, 0, 3, 2, 2, 3, 0, 1, 0, 2, 1, 3]


def prefix(f: int) -> list[int]:
    rng = random.Random(f"family-{f}")
    return [rng.randrange(3, 1000) for _ in range(PREFIX_BLOCKS * BS)]


def prompt(f: int, n: int) -> list[int]:
    rng = random.Random(f"suffix-{f}-{n}")
    return prefix(f) + [rng.randrange(3, 1000) for _ in range(SUFFIX_TOKENS)]


@dataclass(frozen=True)
class Served:
    n: int
    family: int
    response_id: str
    predicted: dict[str, int]  # instance -> the feed's predicted hit (tokens), before the request
    p_cached: int
    d_cached: int


@pytest.fixture(scope="module")
def cluster():
    return shared_cluster("p2d2", p2d2_small_pool_spec)


@pytest.fixture(scope="module")
def feed(cluster):
    # A feed of the test's own, beside the router's: it too must hold the cluster's keys.
    with KvEventFeed(feed_endpoints(cluster.infos), BS, curve=curve_keys(cluster.spec.secret())) as f:
        for name in f.instances:
            f.wait_for(name, lambda s: s.connected, timeout=30)
        yield f


@pytest.fixture(scope="module")
def served(cluster, feed) -> list[Served]:
    out = []
    for n, f in enumerate(ORDER):
        p = prompt(f, n)
        hashes = hittable_hashes(p, BS)
        predicted = {name: feed.matched_tokens(name, hashes) for name in feed.instances}
        r = complete(cluster.url, p, max_tokens=4, request_id=f"kv-{n}-f{f}")
        assert r.status_code == 200, r.text
        feed.catch_up()  # everything the engines published for this request is in
        body = r.json()
        out.append(Served(n, f, body["id"], predicted, body["usage"]["pd"]["p_cached_tokens"],
                          body["usage"]["pd"]["d_cached_tokens"]))
    return out


def routes(cluster, ids: list[str], timeout: float = 10) -> dict[str, tuple[str, str]]:
    """response id -> (P, D) from the run's timelines (a record is written as its request ends)."""
    return {r.request_id: (r.prefill_instance, r.decode_instance)
            for r in run_with(cluster.run_dir, ids, timeout).records}


def test_predicted_hits_equal_what_p_and_d_report(cluster, served):
    route = routes(cluster, [s.response_id for s in served])
    wrong = []
    for s in served:
        p, d = route[s.response_id]
        if (s.predicted[p], s.predicted[d]) != (s.p_cached, s.d_cached):
            wrong.append(f"request {s.n} (family {s.family}) on {p}/{d}: predicted {s.predicted[p]}/"
                         f"{s.predicted[d]}, engines report {s.p_cached}/{s.d_cached}")
    assert not wrong, "\n".join(wrong)


def test_the_sequence_covered_hits_and_evictions_on_both_roles(cluster, served):
    # Not a tautology of the test above: without these cases it would prove little.
    route = routes(cluster, [s.response_id for s in served])
    full = PREFIX_BLOCKS * BS
    seen: set[tuple[str, int]] = set()
    cases = {"P hit": 0, "D hit": 0, "P evicted": 0, "D evicted": 0}
    for s in served:
        for role, inst, cached in (("P", route[s.response_id][0], s.p_cached), ("D", route[s.response_id][1], s.d_cached)):
            if (inst, s.family) in seen:
                cases[f"{role} hit" if cached == full else f"{role} evicted"] += 1
            seen.add((inst, s.family))
    assert all(cases.values()), f"the request order no longer exercises every case: {cases}"


def test_the_feed_lost_nothing(feed, served):
    for name in feed.instances:
        s = feed.status(name)
        assert (s.stale, s.lost, s.errors, s.skipped_events) == (False, 0, 0, 0), s
        assert s.batches > 0, f"{name} published no KV events: kv_events_config not reaching vLLM?"
        assert s.removed_blocks > 0, f"{name} evicted nothing: is num_gpu_blocks_override applied?"


# -- routing on this cluster: the router's own feed, policies switched at run time -------------

ROUTED = Families(count=4, prefix_tokens=PREFIX_BLOCKS * BS, suffix_tokens=SUFFIX_TOKENS)


def test_prefix_aware_keeps_each_family_on_one_p(cluster, served):
    order = shuffled_order(ROUTED.count, rounds=3, seed=3)
    records = under_policy(cluster, "prefix_aware", ROUTED, order, "aware")
    per_family = prefill_instances_per_family(records, order)
    assert all(len(set(ps)) == 1 for ps in per_family.values()), per_family
    assert {ps[0] for ps in per_family.values()} == {"prefill-0", "prefill-1"}, per_family
    assert sum(r.p_cached_tokens for r in records) == structural_max_hit(ROUTED, order, BS)
    assert [r.predicted_p_hit_tokens for r in records] == [r.p_cached_tokens for r in records]
    assert [r.predicted_d_hit_tokens for r in records] == [r.d_cached_tokens for r in records]


def test_round_robin_scatters_families_and_misses(cluster, served):
    order = shuffled_order(ROUTED.count, rounds=3, seed=3)
    records = under_policy(cluster, "round_robin", ROUTED, order, "rr")
    assert any(len(set(ps)) > 1 for ps in prefill_instances_per_family(records, order).values())
    assert sum(r.p_cached_tokens for r in records) < structural_max_hit(ROUTED, order, BS)
