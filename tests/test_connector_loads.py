"""The connector's loads, scheduler side (transfer/connector_loads.py): what a request with a
handle asks of the tier and plans from P, on hand-made vLLM requests and block lists."""

from __future__ import annotations

from test_tier_scheduler import full, hybrid_tier, req, window

from pdcluster.transfer.tier_scheduler import TierCopy


def test_d_loads_the_prefix_from_its_tier_and_pulls_the_rest_and_the_windows_tail_from_p():
    """D's connector (a request with a handle): the tier gives what it holds up to where P's part
    starts; P's plan pairs D's blocks from there, a window group's tail included."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from pdcluster.proto.handle import TransferHandle
    from pdcluster.transfer.connector import PdcConnector
    from pdcluster.transfer.connector_loads import Loads
    from pdcluster.transfer.connector_meta import PdcMetadata

    conn = object.__new__(PdcConnector)
    conn.is_producer, conn.groups, conn._tier = False, (full(0), window(1)), hybrid_tier()
    conn._loads, conn._pending = Loads(conn.groups, conn._tier, failed_recving=True), PdcMetadata()
    d = req("d", "f", 13)
    d.kv_transfer_params = TransferHandle("p-engine", "127.0.0.1:1", "t-1", 13).to_params()
    assert conn.get_num_new_matched_tokens(d, 0) == (13, True)  # all of it external: tier and P
    null = KVCacheBlock(0, is_null=True)
    blocks = KVCacheBlocks(([KVCacheBlock(i) for i in (5, 6, 7, 8)], [null, null, KVCacheBlock(27), KVCacheBlock(28)]))
    conn.update_state_after_alloc(d, blocks, 13)
    assert conn._tier.take_orders().copies == [TierCopy("load", 0, (b"f0", b"f1", b"f2"), (5, 6, 7), "d"),
                                               TierCopy("load", 1, (b"f2",), (27,), "d")]
    (job,) = conn._pending.loads
    assert [(g.remote_indices, g.local_block_ids) for g in job.plan.groups] == [((3,), (8,)), ((3,), (28,))]
    assert (job.plan.d_cached_tokens, job.plan.transferred_tokens) == (12, 1)
    assert conn._loads.reports["d"].d_tier_tokens == 12
