"""End to end with `transfer.on_failure: recompute`: a failed pull makes D prefill itself.

A broken transfer (P's address points nowhere) must give the same tokens as the
normal path, with the report saying nothing came from P.
"""

from __future__ import annotations

import random

import pytest
import ray
from e2e import (
    TRANSPORTS,
    assert_no_kv_in_use,
    complete,
    free_port,
    p1d1_bf16_spec,
    shared_cluster,
    transfer_as,
    wait_until,
)

from pdcluster.proto.handle import TransferHandle
from pdcluster.proto.messages import DecodeRequest, PrefillRequest, SamplingSpec

# One bf16 P1D1 with test_e2e_local_prefill (tests/e2e.py p1d1_bf16_spec: on_failure recompute,
# a short lease), which runs first.
pytestmark = [pytest.mark.e2e, pytest.mark.local_ray, pytest.mark.shared_cluster("p1d1-bf16")]


@pytest.fixture(scope="module")
def cluster():
    cluster = shared_cluster("p1d1-bf16", p1d1_bf16_spec)
    assert cluster.spec.transfer.on_failure == "recompute" and cluster.spec.transfer.lease_s < 20
    return cluster


def pd_tokens(cluster, request_id, prompt, break_handle=False):
    p, d = cluster.prefill[0].actor, cluster.decode[0].actor
    sampling = SamplingSpec(max_tokens=8, temperature=0, ignore_eos=True)
    ray.get(p.prefill.remote(PrefillRequest(request_id, prompt, sampling)))  # the transfer's name: its request id
    address = f"127.0.0.1:{free_port()}" if break_handle else cluster.prefill[0].kv_address
    handle = TransferHandle(cluster.prefill[0].engine_id, address, request_id, len(prompt))
    deltas = [ray.get(ref) for ref in d.decode.options(num_returns="streaming").remote(
        DecodeRequest(request_id, prompt, sampling, handle))]
    return [t for delta in deltas for t in delta.new_token_ids], deltas[-1]


def test_failed_pull_recomputes_same_tokens(cluster):
    prompt = [random.Random(5).randrange(3, 1000) for _ in range(700)]
    broken_tokens, last = pd_tokens(cluster, "recompute-broken", prompt, break_handle=True)
    assert last.finish_reason == "length"
    # Why, from D's worker: nothing listens at the handle's address.
    assert last.transfer.error.startswith("KV pull from P failed: P at 127.0.0.1:"), last.transfer.error
    assert "accepts no connection" in last.transfer.error and last.transfer.transferred_tokens == 0
    cluster_reset = [ray.get(i.actor.reset_prefix_cache.remote()) for i in cluster.decode]
    assert all(cluster_reset)
    normal_tokens, normal = pd_tokens(cluster, "recompute-normal", prompt)
    assert normal.transfer.error is None and normal.transfer.transferred_tokens == 700
    assert broken_tokens == normal_tokens


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_transfer_broken_halfway_recomputes_same_tokens(cluster, mode, transport):
    # A prompt of its own: one that D holds already would be served by D alone (router.local_prefill).
    prompt = [random.Random(f"{mode}-{transport}").randrange(3, 1000) for _ in range(2500)]
    with transfer_as(cluster, mode, transport):
        broken = complete(cluster.url, prompt, 8, request_id=f"fault-{mode}-{transport}")
        for inst in cluster.decode:
            ray.get(inst.actor.reset_prefix_cache.remote())
        normal = complete(cluster.url, prompt, 8)
    assert broken.status_code == 200 == normal.status_code, (broken.text, normal.text)
    why = broken.json()["usage"]["pd"]["transfer_error"]
    # Why, from D's worker: P's abort, or over torch_dist the pair P closed as it aborted, whichever D saw first.
    assert why.startswith("KV pull from P failed: "), why
    assert why.endswith("injected fault") or (transport == "torch_dist" and "closed the channel or died" in why), why
    assert normal.json()["usage"]["pd"]["transfer_error"] is None
    assert broken.json()["choices"][0]["token_ids"] == normal.json()["choices"][0]["token_ids"]
    assert_no_kv_in_use(cluster)


def test_unreleased_lease_expires_and_p_frees_blocks(cluster):
    p = cluster.prefill[0].actor
    pd_tokens(cluster, "never-released", list(range(3, 603)), break_handle=True)
    # D could not release P's lease (wrong address): P holds the blocks until lease_s passes.
    assert ray.get(p.load.remote()).kv_cache_usage > 0
    wait_until(lambda: ray.get(p.load.remote()).kv_cache_usage == 0.0, 20, what="P frees blocks at lease expiry")
