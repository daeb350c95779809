"""Two router processes on one port (bench/router_overhead.py --routers 2, SO_REUSEPORT, as
vLLM's --api-server-count): connections are spread over both, and each request is answered
and recorded by exactly one of them."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from e2e import tiny_model_dir

from pdcluster.bench import router_overhead as ro
from pdcluster.router.timeline import load_run

pytestmark = pytest.mark.e2e

REQUESTS = 40


@pytest.fixture(scope="module")
def two_routers(tmp_path_factory):
    with ro.ray_session():
        yield ro.start_pdcluster(tiny_model_dir(), str(tmp_path_factory.mktemp("runs")), routers=2)


def recorded_ids(cluster) -> list[set[str]]:
    import ray

    return [{r.request_id for r in load_run(d).records} for d in ray.get([r.run_dir.remote() for r in cluster.routers])]


def test_two_routers_share_the_port_and_each_request_is_served_once(two_routers):
    cluster = two_routers
    assert len(set(cluster.router_pids)) == 2, "the two routers should be two processes"
    body = ro.request_body(Path(tiny_model_dir()).name, stream=False)
    sent = set()
    for i in range(REQUESTS):
        with httpx.Client(timeout=30) as client:  # a new connection each: the kernel picks a router per connection
            res = client.post(f"{cluster.url}/v1/completions", json=body, headers={"X-Request-Id": f"shared-{i}"})
        assert res.status_code == 200, res.text
        assert res.json()["usage"]["completion_tokens"] == body["max_tokens"]
        sent.add(res.json()["id"])
    deadline = time.monotonic() + 10
    while sum(map(len, per_router := recorded_ids(cluster))) < REQUESTS and time.monotonic() < deadline:
        time.sleep(0.1)  # a record is appended as its request finishes
    assert all(per_router), f"one router served every connection: {[len(ids) for ids in per_router]}"
    assert not per_router[0] & per_router[1] and per_router[0] | per_router[1] == sent
