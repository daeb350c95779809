"""An instance that Ray restarts on another host, with real vLLM engines in the lab.

P may run on host1 or host2 (`pdc-host: in(host1, host2)`), D on host3. P's host dies; Ray
restarts P on the other one, at other addresses. The router must follow it there: push mode
hands D P's new KV address, and the KV-event feed dials P's new publisher, so new requests
transfer and hit as before, without restarting anything else.
"""

from __future__ import annotations

import random

import httpx
import pytest
import ray
from e2e import assert_no_kv_in_use, cluster_spec_for, health, placed, running_cluster, wait_until

pytestmark = pytest.mark.e2e

LAB_NAME, SUBNET = "pdcmv", "10.213.63.0/24"
P_HOSTS = ("host1", "host2")


@pytest.fixture(scope="module")
def lab():
    from pdcluster.cluster.lab import Lab

    with Lab.up(hosts=3, name=LAB_NAME, subnet=SUBNET) as lab:
        yield lab


@pytest.fixture(scope="module")
def cluster(lab):
    spec = cluster_spec_for("e2e-moves", ray_address=lab.ray_address, transfer={"mode": "push", "lease_s": 15},
                            router={"policy": "prefix_aware"})
    with running_cluster(placed(spec, prefill={"pdc-host": "in(host1, host2)"}, decode={"pdc-host": "host3"})) as c:
        yield c


def post(cluster, prompt: list[int]) -> dict:
    r = httpx.post(f"{cluster.url}/v1/completions", timeout=120,
                   json={"model": "tiny-qwen3", "prompt": prompt, "max_tokens": 3, "temperature": 0,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def p_node(cluster) -> str:
    return ray.get(cluster.prefill[0].actor.info.remote(), timeout=60).node_ip


def test_p_restarted_on_another_host_is_followed_there(lab, cluster):
    rng = random.Random(7)
    before = p_node(cluster)
    host_of = {lab.host(h).address: h for h in P_HOSTS}
    assert before in host_of
    first = [rng.randrange(5, 1000) for _ in range(1024 + 100)]
    assert post(cluster, first)["pd"]["transfer_error"] is None

    lab.kill_host(host_of[before])
    # Ray declares the node dead, restarts P on the other host; the router's channel reopens there.
    wait_until(lambda: health(cluster)["prefill-0"] is False, 30, what="prefill-0 down")
    wait_until(lambda: httpx.get(f"{cluster.url}/health", timeout=10).status_code == 200, 180,
               what="prefill-0 back, on the other host")
    after = p_node(cluster)
    assert after in host_of and after != before

    # Push mode: D fetched from P's new KV address (a stale one fails after 5 s, as a transfer error).
    second = [rng.randrange(5, 1000) for _ in range(1024 + 50)]
    usage = post(cluster, second)
    assert usage["pd"]["transfer_error"] is None and usage["pd"]["transferred_tokens"] == len(second)
    # The feed follows P's new publisher: it learns what the new P stored, and routes a repeat to it.
    status = wait_until(lambda: (s := ray.get(cluster.router.kv_event_status.remote())["prefill-0"]).connected
                        and s.blocks > 0 and s, 30, what="the feed following the new P")
    assert status.connections >= 2 and not status.stale
    again = post(cluster, second)
    assert again["pd"]["p_cached_tokens"] == 1024 and again["pd"]["transfer_error"] is None
    assert_no_kv_in_use(cluster, timeout=30)
