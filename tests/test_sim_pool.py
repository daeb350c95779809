"""The pool on the real-time simulated engine (cluster/sim/producer.py `offer_pool`): P offers the run
of a prompt's first blocks its tier's book holds, their payload made from their keys; a peer pulls
them over P's real KV server and finds each row as P's steps would have written it."""

from __future__ import annotations

from transfer_fakes import SECRET, wait_results

from pdcluster.cluster.sim import payload
from pdcluster.cluster.sim.block_pool import hash_blocks
from pdcluster.cluster.sim.cost import CostModel, SimParams
from pdcluster.cluster.sim.producer import ProducerSide
from pdcluster.proto.handle import TransferHandle
from pdcluster.proto.spec import SHIPPED_SIM_PARAMS
from pdcluster.transfer.grpc_client import KvFetcher, LoadJob
from pdcluster.transfer.plan import GroupPlan, TransferPlan

BS, SCALE, BLOCKS = 128, 65536, 32


def test_a_peer_pulls_the_pools_run_and_every_row_is_the_prompts():
    cost = CostModel(SimParams.load(SHIPPED_SIM_PARAMS / "dsv4-flash-910c.yaml"), BS, 1)  # full, window, compressed
    components = cost.components
    p_kv = payload.make_paged_kv(components, BLOCKS, SCALE)
    producer = ProducerSide("p0", components, p_kv, BS, "127.0.0.1", 0, 1 << 20, lease_s=60, timeout_s=5,
                            break_prefix=None, channel_backend=None, secret=SECRET)
    d_kv = payload.make_paged_kv(components, BLOCKS, SCALE)
    fetcher = KvFetcher("d0", d_kv, 5, secret=SECRET)
    try:
        prompt = list(range(100, 100 + 5 * BS + 3))
        hashes = hash_blocks(prompt, BS)
        producer.offer_pool("pool-1", hashes, prompt[:3 * BS], lease_s=60)  # the tier holds the first 3 blocks
        local = (9, 4, 20)
        plan = TransferPlan(tuple(GroupPlan(gi, "full_attention", (0, 1, 2), local) for gi in range(len(components))),
                            d_cached_tokens=0, transferred_tokens=3 * BS)
        fetcher.submit(LoadJob("d-1", TransferHandle("p0", producer.server.address, "pool-1", 3 * BS), plan))
        results = wait_results(fetcher, ["d-1"])
        assert results.finished == {"d-1"} and not results.failed, results
        keys = payload.block_keys(hashes, prompt, BS)  # as D checks a pull from a prefill (consumer.py)
        for gi, c in enumerate(components):
            assert payload.mismatched(d_kv, gi, c.name, list(local), keys[:3]) == [], c.name
        assert len(producer.sources) == 0  # D released it: the pooled source ended at once
    finally:
        fetcher.stop()
        producer.stop()
