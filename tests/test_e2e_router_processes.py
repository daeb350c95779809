"""Two router processes on one port (router.processes: 2, SO_REUSEPORT, as vLLM's
--api-server-count), in front of simulated P1D1: connections are spread over both, each
request is answered and recorded once in the one run directory, and either router's
/metrics counts every request."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
from e2e import assert_no_kv_in_use, cluster_spec_for, complete, running_cluster, wait_until

from pdcluster.router.run_store import load_run

pytestmark = [pytest.mark.e2e, pytest.mark.local_ray]

REQUESTS = 24


@pytest.fixture(scope="module")
def cluster():
    spec = cluster_spec_for("e2e-routers", engine={"kind": "sim", "max_model_len": 8192},
                            sim={"params": "qwen3-0.6b-1dev", "payload_scale": 1024, "kv_blocks": 128},
                            router={"processes": 2})
    with running_cluster(spec) as c:
        yield c


@pytest.fixture(scope="module")
def served(cluster):
    """REQUESTS requests, each on a new connection (the kernel picks a router per connection)."""
    ids = []
    for i in range(REQUESTS):
        res = complete(cluster.url, [5 + i] * 300, max_tokens=4, request_id=f"two-routers-{i}")
        assert res.status_code == 200, res.text
        assert len(res.json()["choices"][0]["token_ids"]) == 4
        ids.append(res.json()["id"])
    return ids


def test_the_routers_are_two_processes_on_one_node(cluster):
    import ray

    assert len(cluster.routers) == 2
    assert len(set(ray.get([r.node_id.remote() for r in cluster.routers]))) == 1
    assert cluster.each_router("set_policy", "least_load") == [None, None]
    cluster.each_router("set_policy", cluster.spec.router.policy)


def test_each_request_is_recorded_once_in_the_one_run(cluster, served):
    run = load_run(cluster.run_dir)
    assert sorted(r.request_id for r in run.records) == sorted(served)
    assert all(not r.error and r.output_tokens == 4 for r in run.records)
    writers = {f.name: len(f.read_text().splitlines()) for f in Path(cluster.run_dir).glob("requests*.jsonl")}
    assert set(writers) == {"requests.jsonl", "requests-1.jsonl"} and all(writers.values()), (
        f"one router served every connection: {writers}")
    assert_no_kv_in_use(cluster)


def test_either_routers_metrics_count_every_request(cluster, served):
    for _ in range(12):  # a new connection each: both routers answer some of these (but 2 in 4,096 runs)
        text = httpx.get(f"{cluster.url}/metrics", timeout=30).text
        line = next(x for x in text.splitlines() if x.startswith('pdc_requests_total{outcome="ok"}'))
        assert float(line.split()[-1]) == REQUESTS


def test_a_router_crashed_mid_load_leaves_its_run_readable_and_comes_back(cluster, served):
    """Issue 16 item 6: router 0's process killed (not ray.kill: Ray restarts it) with
    requests in flight on both routers. Its run loads: every request sent has a record or is
    listed unfinished, and the restarted router records into the same run."""
    import ray

    def router0(fn, timeout=5):
        try:
            return ray.get(cluster.routers[0].__ray_call__.remote(fn), timeout=timeout)
        except (ray.exceptions.RayError, TimeoutError):  # dead, restarting
            return None

    before = router0(lambda router: os.getpid())
    in_flight = [f"mid-load-{i}" for i in range(12)]  # a new connection each: both routers get some
    with ThreadPoolExecutor(len(in_flight)) as pool:
        answers = [pool.submit(_complete_or_error, cluster.url, rid) for rid in in_flight]
        wait_until(lambda: sum(ray.get([r.__ray_call__.remote(lambda router: router.dispatcher.accepted_in_flight)
                                        for r in cluster.routers])) == len(in_flight), 30,
                   what="every request in flight")
        psutil.Process(before).kill()  # a crash mid-load
        statuses = [a.result() for a in answers]
    assert any(s is None for s in statuses), f"router 0's clients lost their connection: {statuses}"
    with pytest.warns(RuntimeWarning, match="came in and have no record"):
        crashed = load_run(cluster.run_dir)
    had = {r.request_id for r in crashed.records} | {u.request_id for u in crashed.unfinished}
    assert {f"cmpl-{rid}" for rid in in_flight} <= had, "a request sent is in neither a record nor unfinished"
    assert {u.file for u in crashed.unfinished} == {"requests.jsonl"}  # router 0's file: only it crashed
    assert len(crashed.unfinished) == statuses.count(None)

    wait_until(lambda: router0(lambda router: os.getpid()) not in (None, before) and router0(
        lambda router: bool(router._server and router._server.started)), 90, interval=0.5, what="router 0 back, serving")
    ids = []
    for i in range(8):  # new connections: some reach the restarted router
        res = complete(cluster.url, [9 + i] * 300, max_tokens=4, request_id=f"after-crash-{i}")
        assert res.status_code == 200, res.text
        ids.append(res.json()["id"])
    with pytest.warns(RuntimeWarning, match="came in and have no record"):
        records = {r.request_id for r in load_run(cluster.run_dir).records}
    assert set(ids) <= records  # one run, written by both routers and the restarted one
    assert any(f.name not in ("requests.jsonl", "requests-1.jsonl") for f in Path(cluster.run_dir).glob("requests*"))
    assert_no_kv_in_use(cluster)  # the engines ended what the dead router had sent them


def _complete_or_error(url: str, request_id: str) -> int | None:
    """The HTTP status, or None when the connection broke (its router died)."""
    try:
        return complete(url, [11] * 300, max_tokens=800, request_id=request_id).status_code
    except httpx.TransportError:
        return None


def test_one_x_request_id_sent_to_both_routers_at_once_is_served_every_time(cluster, served):
    """Issue 26 item 6: the engines' request and transfer ids were the client's id plus a count
    per router process, so both routers could name one transfer on P (its step asserted)."""
    prompts = [[40 + i] * 700 for i in range(8)]  # 8 connections: both routers get some (but 2 in 256)
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: complete(cluster.url, p, max_tokens=4, request_id="same-id"), prompts))
    assert [a.status_code for a in answers] == [200] * len(prompts), [a.text for a in answers]
    assert all(len(a.json()["choices"][0]["token_ids"]) == 4 for a in answers)
    assert_no_kv_in_use(cluster)


def test_with_one_router_dead_the_other_serves_and_metrics_name_the_dead_one(cluster, served):
    """Last in this module: it kills router-1."""
    import ray

    port = cluster.spec.router.port
    assert _listeners(port) == 2
    ray.kill(cluster.routers[1], no_restart=True)
    # Until its listening socket is closed: Ray calls an actor dead sooner, and its process's
    # leader thread shows as a zombie while its other threads (holding its descriptors) still
    # exit; a connection queued on that socket meanwhile is reset when it closes.
    wait_until(lambda: _listeners(port) == 1, 30, interval=0.05, what="router-1's listening socket closed")
    for i in range(8):  # a new connection each: the kernel hands them all to router 0 now
        res = complete(cluster.url, [7 + i] * 300, max_tokens=4, request_id=f"one-router-{i}")
        assert res.status_code == 200, res.text
    res = httpx.get(f"{cluster.url}/metrics", timeout=30)
    assert res.status_code == 503 and "router-1" in res.json()["error"]["message"], res.text


def _listeners(port: int) -> int:
    """Listening TCP sockets on `port` in this network namespace (where both routers bind it)."""
    return sum(1 for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port)
