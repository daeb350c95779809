"""The pool's serving side (issue 29 item 2): a run of a prompt's first blocks in P's host tier,
pinned and offered as a transfer source that a peer reads over P's KV server, as it reads a prefill;
evictions the book orders meanwhile wait for the read; the source ends without a vLLM request."""

from __future__ import annotations

import grpc
import pytest
import torch
from transfer_fakes import BLOCK_SIZE, LAYERS, TIMEOUT_S, make_job, wait_results

from pdcluster.proto.kv_groups import KvGroup
from pdcluster.transfer import kv_transfer_pb2 as pb
from pdcluster.transfer.host_tier import HostTier

HASHES = [bytes([i]) * 32 for i in range(4)]  # a prompt's first four blocks (vLLM's hashes)
P_IDS = (2, 5, 7)  # where P computed the first three
GROUPS = (KvGroup("full_attention", BLOCK_SIZE),)


def kept(p) -> tuple[HostTier, dict[str, torch.Tensor]]:
    """P's tier holding the prompt's first three blocks; what they held (P's cache then overwritten,
    so that a read can only have come from the tier)."""
    tier = HostTier(p.kv)
    tier.store([(0, h) for h in HASHES[:3]], P_IDS)
    want = {name: p.kv.gather(name, list(P_IDS)).clone() for name in LAYERS}
    for name in LAYERS:
        p.kv.view(name)[list(P_IDS)] = 0
    return tier, want


def test_a_peer_reads_the_tiers_run_over_the_kv_plane(make_p, make_d):
    p, d = make_p(), make_d()
    tier, want = kept(p)
    run = tier.read_run(HASHES, GROUPS)  # the fourth block is not in the tier: the run is three
    assert run.num_tokens == 3 * BLOCK_SIZE
    p.sources.offer_pooled("pool-1", run, 3 * BLOCK_SIZE, lease_s=60)
    d.fetcher.submit(make_job(p.server.address, [0, 1, 2], [1, 2, 3], transfer_id="pool-1", num_blocks=3))
    results = wait_results(d.fetcher, ["d-pool-1"])
    assert results.finished == {"d-pool-1"} and not results.failed
    for name in LAYERS:
        assert torch.equal(d.kv.gather(name, [1, 2, 3]), want[name])
    # D released it: it ended at once (P may be idle: no step to sweep it), its blocks unpinned,
    # and there is no vLLM request to report.
    assert run.closed and len(p.sources) == 0 and p.sources.take_finished() == set()


@pytest.mark.parametrize("layout", ["cpu", "flash"])
def test_the_pools_run_crosses_the_torch_dist_channel_too(gloo_pair, layout):
    p, d = gloo_pair(layout)
    tier, want = kept(p)
    p.sources.offer_pooled("pool-dist", tier.read_run(HASHES, GROUPS), 3 * BLOCK_SIZE, lease_s=60)
    d.fetcher.submit(make_job(p.server.address, [0, 1, 2], [6, 1, 3], transfer_id="pool-dist", num_blocks=3,
                              transport="torch_dist"))
    results = wait_results(d.fetcher, ["d-pool-dist"])
    assert results.finished == {"d-pool-dist"} and not results.failed, results
    for name in LAYERS:
        assert torch.equal(d.kv.gather(name, [6, 1, 3]), want[name])


def test_an_eviction_during_the_read_waits_for_it(make_p, make_d):
    p, d = make_p(), make_d()
    tier, want = kept(p)
    run = tier.read_run(HASHES[:2], GROUPS)
    p.sources.offer_pooled("pool-2", run, 2 * BLOCK_SIZE, lease_s=60)
    tier.evict([(0, h) for h in HASHES[:3]])  # the book needs the room now
    assert (0, HASHES[0]) not in tier and (0, HASHES[2]) not in tier and tier.read_run(HASHES, GROUPS).num_tokens == 0
    d.fetcher.submit(make_job(p.server.address, [0, 1], [4, 5], transfer_id="pool-2", num_blocks=2))
    assert wait_results(d.fetcher, ["d-pool-2"]).failed == set()
    for name in LAYERS:
        assert torch.equal(d.kv.gather(name, [4, 5]), want[name][:2])
    p.sources.take_finished()
    assert tier.nbytes == 0  # the pinned blocks went with the read


def test_a_read_past_the_run_is_refused_and_an_expired_one_is_gone(make_p, stub_to):
    p = make_p()
    tier, _ = kept(p)
    p.sources.offer_pooled("pool-3", tier.read_run(HASHES, GROUPS), 3 * BLOCK_SIZE, lease_s=60)
    dup = tier.read_run(HASHES, GROUPS)
    with pytest.raises(ValueError, match="pool-3 already has a source"):
        p.sources.offer_pooled("pool-3", dup, 3 * BLOCK_SIZE, lease_s=60)
    dup.close()
    with pytest.raises(grpc.RpcError) as err:
        list(stub_to(p.server.address).ReadBlocks(pb.ReadBlocksRequest(
            transfer_id="pool-3", groups=[pb.GroupBlocks(group=0, block_indices=[3])]), timeout=TIMEOUT_S))
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE  # the run is three blocks
    expired = tier.read_run(HASHES, GROUPS)
    p.sources.offer_pooled("pool-4", expired, 3 * BLOCK_SIZE, lease_s=0.0)
    with pytest.raises(grpc.RpcError) as err:
        list(stub_to(p.server.address).ReadBlocks(pb.ReadBlocksRequest(
            transfer_id="pool-4", groups=[pb.GroupBlocks(group=0, block_indices=[0])]), timeout=TIMEOUT_S))
    assert "expired" in err.value.details()
    p.sources.release("pool-3")
    assert len(p.sources) == 1 and not expired.closed  # an expired one waits for a sweep: the next offer
    p.sources.offer_pooled("pool-5", tier.read_run(HASHES[:1], GROUPS), BLOCK_SIZE, lease_s=0.0)
    assert expired.closed and p.sources.take_finished() == set() and len(p.sources) == 0


def test_a_prompts_block_hashes_are_the_engines():
    """The actor names the tier's blocks by vLLM's hashes (transfer/pool_worker.py), as the engine's
    scheduler keys them: the chain cluster/sim/kv_wire.py restates (itself pinned to vLLM's)."""
    from pdcluster.cluster.sim.kv_wire import block_hash
    from pdcluster.transfer.pool_worker import prompt_block_hashes

    tokens = list(range(100, 100 + 4 * BLOCK_SIZE + 1))  # four full blocks, then the last token
    want, parent = [], None
    for i in range(4):
        parent = block_hash(parent, tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
        want.append(parent)
    assert prompt_block_hashes(tokens, BLOCK_SIZE) == want
    assert prompt_block_hashes(tokens[:-1], BLOCK_SIZE) == want[:3]  # its last token is the reader's to compute
