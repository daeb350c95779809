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


def test_p_reads_a_peers_tier_then_computes_on_and_reports_the_read():
    """P's connector (a request producing for D, with a pool handle): the peer's run is loaded as
    D loads P's KV, P's own device hit first; P still produces for D; its report says what it read."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.outputs import KVConnectorOutput

    from pdcluster.proto.handle import PRODUCE_KEY, TransferHandle
    from pdcluster.proto.messages import TransferStats
    from pdcluster.transfer.connector import P_POOL_KEY, P_TIER_FAILED_KEY, PdcConnector
    from pdcluster.transfer.connector_loads import Loads
    from pdcluster.transfer.connector_meta import PdcMetadata
    from pdcluster.transfer.vllm_compat import RequestStatus

    conn = object.__new__(PdcConnector)
    conn.is_producer, conn.groups, conn._tier, conn._tables = True, (full(0),), None, None
    conn._loads, conn._pending = Loads(conn.groups, None, failed_recving=True), PdcMetadata()
    conn._producing, conn._ran = {}, set()
    p = req("p", "f", 13)
    p.kv_transfer_params = {PRODUCE_KEY: "t-p", **TransferHandle("peer", "127.0.0.1:1", "pool-1", 8).to_params()}
    assert conn.get_num_new_matched_tokens(p, 4) == (4, True)  # its own hit of 4, then the peer's 4 more
    # With a load under way vLLM allocates the hit's block and the load's, nothing for compute yet.
    conn.update_state_after_alloc(p, KVCacheBlocks(([KVCacheBlock(5, _block_hash=b"h"), KVCacheBlock(6)],)), 4)
    assert conn._producing["p"][0] == "t-p"
    (job,) = conn._pending.loads
    assert job.handle.transfer_id == "pool-1" and [(g.remote_indices, g.local_block_ids) for g in job.plan.groups] \
        == [((1,), (6,))]
    conn.update_connector_output(KVConnectorOutput(finished_recving={"p"}))
    p.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = conn.request_finished(p, [5, 6, 7, 8])
    assert not delay and TransferStats.from_params(params[P_POOL_KEY]).transferred_tokens == 4
    assert P_TIER_FAILED_KEY not in params
    # A read that failed: its tokens were computed, and P's report says so.
    q = req("q", "f", 13)
    q.kv_transfer_params = p.kv_transfer_params | {PRODUCE_KEY: "t-q"}
    assert conn.get_num_new_matched_tokens(q, 0) == (8, True)
    conn.update_state_after_alloc(q, KVCacheBlocks(([KVCacheBlock(1), KVCacheBlock(2)],)), 8)
    conn.update_connector_output(KVConnectorOutput(failed_recving={"q"}))
    q.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = conn.request_finished(q, [1, 2, 3, 4])
    assert params[P_TIER_FAILED_KEY] == 8 and TransferStats.from_params(params[P_POOL_KEY]).error
