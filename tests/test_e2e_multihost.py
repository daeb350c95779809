"""P on one host, D on another, the router on a third: real vLLM engines in the multi-host lab.

The lab (cluster/lab.py) makes three hosts (network namespaces, each a labelled Ray node)
beside its head (the root namespace, where this test and the router run). The spec puts P
on host1 or host2 (`pdc-host: in(host1, host2)`) and D on host3 by Ray labels; every plane
binds its host's lab address. The intruders dial those addresses without the cluster secret.
Last, P's host dies: Ray restarts P on the other one, at other addresses, and the router
follows it there (push mode hands D P's new KV address; the KV-event feed dials P's new
publisher), without restarting anything else.
"""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
import ray
from e2e import (
    assert_no_kv_in_use,
    cluster_spec_for,
    evil_pickle,
    health,
    placed,
    reset_caches,
    running_cluster,
    seed_prompts_000,
    tiny_model_dir,
    wait_until,
)

pytestmark = pytest.mark.e2e

LAB_NAME, SUBNET = "pdcmh", "10.213.60.0/24"
API_KEY = "sk-e2e-multihost"
P_HOSTS = ("host1", "host2")


@pytest.fixture(scope="module")
def lab():
    from pdcluster.cluster.lab import Lab

    # A short tolerance: the last test kills P's host and waits for Ray to restart P on the other.
    with Lab.up(hosts=3, name=LAB_NAME, subnet=SUBNET, partition_tolerance_s=3.0) as lab:
        yield lab


@pytest.fixture(scope="module")
def cluster(lab):
    spec = cluster_spec_for("e2e-multihost", ray_address=lab.ray_address, auth={"api_keys": [API_KEY]},
                            transfer={"mode": "push", "lease_s": 15}, router={"policy": "prefix_aware"})
    # Each role on its own host, by the lab's labels; P may be restarted on the other of two.
    with running_cluster(placed(spec, prefill={"pdc-host": f"in({', '.join(P_HOSTS)})"},
                                decode={"pdc-host": "host3"})) as c:
        yield c


@pytest.fixture(scope="module")
def reference(cluster):
    from pdcluster.cluster.reference_engine import GreedyReference

    return ray.remote(num_cpus=0)(GreedyReference).options(label_selector={"pdc-host": "head"}).remote(
        tiny_model_dir(), "0")


def run(cluster, prompt, max_tokens=3, key: str | None = API_KEY) -> tuple[list[int], dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(f"{cluster.url}/v1/completions", headers=headers, timeout=120,
                   json={"model": "tiny-qwen3", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                         "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"], r.json()["usage"]


def test_each_role_runs_on_its_host_and_every_plane_binds_that_hosts_address(lab, cluster):
    host = {i.name: i for i in cluster.infos}
    p_host = next(h for h in P_HOSTS if lab.host(h).address == host["prefill-0"].node_ip)
    for name, lab_host in (("prefill-0", lab.host(p_host)), ("decode-0", lab.host("host3"))):
        info = host[name]
        assert info.node_ip == info.planes.host == lab_host.address, info
        for endpoint in (info.planes.request_channel, info.planes.kv_events, info.planes.kv_events_replay):
            assert endpoint.removeprefix("tcp://").startswith(f"{lab_host.address}:"), endpoint
    assert host["prefill-0"].kv_address.startswith(f"{lab.host(p_host).address}:")
    assert cluster.spec.network.mode == "node"
    # The router runs on the head (the node `build_cluster` ran on), apart from both engines' hosts.
    head = next(n.node_id for n in lab.ray_nodes() if n.alive and n.address == lab.head_address)
    assert ray.get(cluster.router.node_id.remote()) == head


@pytest.fixture(scope="module")
def seed_prompts():
    return seed_prompts_000()


def test_the_first_seed_across_hosts(cluster, reference, seed_prompts):
    """COLD B 0, B after A 1,024, B' 0, tokens equal a single engine's; P's KV crossed the lab's bridge."""
    a, b, b_changed = seed_prompts
    reset_caches(cluster, 10)
    cold_tokens, cold = run(cluster, b)
    assert cold["pd"] == {"p_cached_tokens": 0, "d_cached_tokens": 0, "transferred_tokens": 1038,
                          "transfer_error": None, "prefill_instance": "prefill-0", "local_prefill": False,
                          "pool_tokens": 0, "migrations": 0}
    reset_caches(cluster, 10)
    run(cluster, a)
    warm_tokens, warm = run(cluster, b)
    assert warm["prompt_tokens_details"]["cached_tokens"] == 1024
    assert warm["pd"] == {"p_cached_tokens": 1024, "d_cached_tokens": 1024, "transferred_tokens": 14,
                          "transfer_error": None, "prefill_instance": "prefill-0", "local_prefill": False,
                          "pool_tokens": 0, "migrations": 0}  # D pulls only what it lacks, across hosts
    reset_caches(cluster, 10)
    run(cluster, a)
    changed_tokens, changed = run(cluster, b_changed)
    assert changed["prompt_tokens_details"]["cached_tokens"] == 0 and changed["pd"]["d_cached_tokens"] == 0
    want = ray.get(reference.greedy.remote(b, 3))
    assert cold_tokens == warm_tokens == want
    assert changed_tokens == ray.get(reference.greedy.remote(b_changed, 3))


def test_a_repeated_request_moves_only_its_tail(cluster, seed_prompts):
    _, b, _ = seed_prompts
    first_tokens, _ = run(cluster, b, 4)
    again_tokens, again = run(cluster, b, 4)
    assert again_tokens == first_tokens
    assert again["pd"]["d_cached_tokens"] == 1024 and again["pd"]["transferred_tokens"] == len(b) - 1024


def test_the_api_wants_a_key_and_health_does_not(cluster, seed_prompts):
    body = {"model": "tiny-qwen3", "prompt": [1, 2, 3], "max_tokens": 2}
    assert httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=30).status_code == 401
    wrong = httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=30,
                       headers={"Authorization": "Bearer sk-not-this"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{cluster.url}/health", timeout=30).status_code == 200
    assert run(cluster, [1, 2, 3], 2)[0]  # with the key


async def _intrude_stream(host: str, port: int, payload: bytes) -> bytes:
    """Connect, send `payload` after whatever the server says first; what the server sent before closing."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        got = await asyncio.wait_for(reader.read(64), 5)
        writer.write(payload)
        rest = await asyncio.wait_for(reader.read(), 10)
        return got + rest
    finally:
        writer.close()


def test_every_plane_on_a_lab_address_refuses_peers_without_the_secret(cluster, seed_prompts, tmp_path):
    import grpc
    import zmq

    from pdcluster.transfer import kv_transfer_pb2 as pb

    marker = tmp_path / "ran"
    evil = evil_pickle(marker)
    infos = {i.name: i for i in cluster.infos}
    # The request channels (P's and D's): garbage, a pickle, a made-up proof. Each is dropped.
    for name in ("prefill-0", "decode-0"):
        host, port = infos[name].planes.request_channel.rsplit(":", 1)
        for payload in (b"GET / HTTP/1.1\r\n\r\n", evil, b"PDC1" + b"\0" * 48):
            got = asyncio.run(_intrude_stream(host, int(port), payload))
            assert len(got) == 20, f"{name}'s request channel answered more than its hello: {got!r}"
    # P's KV service: no token; and a pickle as a request body.
    channel = grpc.insecure_channel(infos["prefill-0"].kv_address)
    for method, request in (("ReadBlocks", pb.ReadBlocksRequest(transfer_id="x").SerializeToString()),
                            ("Release", pb.ReleaseRequest(transfer_id="x").SerializeToString()),
                            ("ChannelStore", pb.StoreRequest(channel="x", op="get", key="k").SerializeToString()),
                            ("OpenChannel", evil)):
        call = (channel.unary_stream if method == "ReadBlocks" else channel.unary_unary)(
            f"/pdcluster.transfer.KvTransfer/{method}")
        with pytest.raises(grpc.RpcError) as err:
            out = call(request, timeout=10)
            list(out) if method == "ReadBlocks" else None
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED, (method, err.value)
    channel.close()
    # The KV events (both sockets): a subscriber and a replay request without the keys get nothing.
    ctx = zmq.Context()
    sub, dealer = ctx.socket(zmq.SUB), ctx.socket(zmq.DEALER)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(infos["prefill-0"].planes.kv_events)
    dealer.connect(infos["prefill-0"].planes.kv_events_replay)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    _, b, _ = seed_prompts
    reset_caches(cluster, 10)
    run(cluster, b)  # P publishes its stored blocks
    assert not sub.poll(2000) and not dealer.poll(500), "a peer without the keys read KV events"
    for s in (sub, dealer):
        s.close(linger=0)
    ctx.term()
    assert not marker.exists()
    # And the cluster itself is served as before, its own feed still following every engine.
    run(cluster, b)
    status = ray.get(cluster.router.kv_event_status.remote())
    assert all(s.connected and s.batches > 0 for s in status.values()), status


def test_no_block_is_left_in_use(cluster):
    assert_no_kv_in_use(cluster)


def p_node(cluster) -> str:
    return ray.get(cluster.prefill[0].actor.info.remote(), timeout=60).node_ip


def test_p_restarted_on_another_host_is_followed_there(lab, cluster):
    """Last in the module: it kills a host."""
    rng = random.Random(7)
    before = p_node(cluster)
    host_of = {lab.host(h).address: h for h in P_HOSTS}
    assert before in host_of
    first = [rng.randrange(5, 1000) for _ in range(1024 + 100)]
    assert run(cluster, first)[1]["pd"]["transfer_error"] is None

    lab.kill_host(host_of[before])
    # Ray declares the node dead, restarts P on the other host; the router's channel reopens there.
    wait_until(lambda: health(cluster)["prefill-0"] is False, 30, what="prefill-0 down")
    wait_until(lambda: httpx.get(f"{cluster.url}/health", timeout=10).status_code == 200, 180,
               what="prefill-0 back, on the other host")
    after = p_node(cluster)
    assert after in host_of and after != before

    # Push mode: D fetched from P's new KV address (a stale one fails after 5 s, as a transfer error).
    second = [rng.randrange(5, 1000) for _ in range(1024 + 50)]
    usage = run(cluster, second)[1]
    assert usage["pd"]["transfer_error"] is None and usage["pd"]["transferred_tokens"] == len(second)
    # The feed follows P's new publisher: it learns what the new P stored, and routes a repeat to it.
    status = wait_until(lambda: (s := ray.get(cluster.router.kv_event_status.remote())["prefill-0"]).connected
                        and s.blocks > 0 and s, 30, what="the feed following the new P")
    assert status.connections >= 2 and not status.stale
    again = run(cluster, second)[1]
    assert again["pd"]["p_cached_tokens"] == 1024 and again["pd"]["transfer_error"] is None
    assert_no_kv_in_use(cluster, timeout=30)
