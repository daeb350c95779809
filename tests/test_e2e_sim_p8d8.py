"""End to end: deploy/p8d8-sim.yaml itself (8 P + 8 D simulated DeepSeek-V4-Flash instances,
prefix_aware routing, push transfer) under a short concurrent load through the router.

Every request succeeds, every timeline is complete and ordered, and at the end every
instance's blocks are all free (cached counts as free) and its pool's invariants hold.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import ray
from e2e import assert_no_kv_in_use, complete, free_port, free_port_run, running_cluster

from pdcluster.cluster.spec import load_spec
from pdcluster.router.attribution import attribute
from pdcluster.router.timeline import EVENT_ORDER, load_run

pytestmark = pytest.mark.e2e
DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "p8d8-sim.yaml"
FAMILIES, PER_FAMILY, PROMPT, SHARED = 6, 6, 16_384, 14_848  # 116 of 128 blocks shared (90.6%)


@pytest.fixture(scope="module")
def cluster():
    spec = load_spec(DEPLOY)
    spec = spec.model_copy(update={
        "name": "e2e-p8d8-sim",
        "transfer": spec.transfer.model_copy(update={"base_port": free_port_run(8)}),
        "router": spec.router.model_copy(update={"port": free_port(), "kv_events_port": free_port_run(32)})})
    with running_cluster(spec) as c:
        yield c


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    heads = [[rng.randrange(3, 1000) for _ in range(SHARED)] for _ in range(FAMILIES)]
    out = [h + [rng.randrange(3, 1000) for _ in range(PROMPT - SHARED)] for _ in range(PER_FAMILY) for h in heads]
    return out


@pytest.fixture(scope="module")
def load(cluster):
    """Every family's first request alone, then the rest 24 at a time."""
    ps = prompts()

    def one(p):
        r = complete(cluster.url, p, max_tokens=64, timeout=300)
        return r.status_code, r.json() if r.status_code == 200 else r.text

    with ThreadPoolExecutor(24) as pool:
        results = list(pool.map(one, ps[:FAMILIES])) + list(pool.map(one, ps[FAMILIES:]))
    time.sleep(0.5)  # the router appends a record as a request ends
    return results, load_run(cluster.run_dir).records


def test_every_request_succeeds_and_the_family_prefix_hits(load):
    results, _ = load
    assert [status for status, _ in results] == [200] * len(results), [b for s, b in results if s != 200][:3]
    later = [body["usage"]["pd"]["p_cached_tokens"] for _, body in results[FAMILIES:]]
    assert sum(hit == SHARED for hit in later) >= len(later) // 2, later  # most go to the P holding their family


def test_every_timeline_is_complete_and_ordered(load):
    results, records = load
    assert len(records) == len(results)
    for rec in records:
        assert rec.error is None and rec.output_tokens == 64, (rec.request_id, rec.error)
        assert [e for e in EVENT_ORDER if e not in rec.events] == [], rec.request_id
        assert rec.out_of_order() == [], (rec.request_id, rec.out_of_order())
        assert attribute(rec).complete


def test_every_instances_blocks_are_free_and_conserved_at_the_end(cluster, load):
    assert_no_kv_in_use(cluster, timeout=60)
    for inst in cluster.instances:
        counts = ray.get(inst.actor.check_blocks.remote())  # raises if an invariant broke
        assert counts["held"] == 0 and counts["free"] == counts["total"], (inst.name, counts)
