"""An instance's host tier, worker side (transfer/host_tier.py, issue 29): blocks copied out of a
paged KV cache and back into other blocks byte for byte, in vLLM's CPU and flash-attn layouts."""

from __future__ import annotations

import time

import pytest
import torch
from transfer_fakes import LAYERS, LAYOUTS, P_BLOCKS, block, source_caches

from pdcluster.proto.kv_groups import KvGroup
from pdcluster.transfer.host_tier import HostTier
from pdcluster.transfer.paged_kv import PagedKv


def keys(*names: str, group: int = 0) -> list[tuple[int, bytes]]:
    return [(group, n.encode()) for n in names]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_blocks_come_back_byte_for_byte_into_other_blocks(layout):
    shape_fn, block_dim = LAYOUTS[layout]
    caches = source_caches(shape_fn(P_BLOCKS))
    tier = HostTier(PagedKv(caches, dict.fromkeys(LAYERS, 0), P_BLOCKS))
    tier.store(keys("a", "b", "c"), [2, 5, 7])
    for t in caches.values():  # the engine reuses every block: the tier's copies are its own
        t.zero_()
    tier.load(keys("c", "a"), [1, 9])
    want = source_caches(shape_fn(P_BLOCKS))
    for name in LAYERS:
        assert torch.equal(block(caches[name], block_dim, 1), block(want[name], block_dim, 7))
        assert torch.equal(block(caches[name], block_dim, 9), block(want[name], block_dim, 2))
        assert not block(caches[name], block_dim, 0).any()  # nothing else written
    per_block = sum(block(want[n], block_dim, 0).numel() * 4 for n in LAYERS)
    assert tier.block_bytes(0) == per_block and tier.nbytes == 3 * per_block


def test_the_tier_counts_what_it_held_loaded_stored_and_offered_peers():
    caches = source_caches(LAYOUTS["cpu"][0](P_BLOCKS))
    tier = HostTier(PagedKv(caches, dict.fromkeys(LAYERS, 0), P_BLOCKS))
    bb = tier.block_bytes(0)
    tier.store(keys("a", "b", "c"), [1, 2, 3])
    tier.load(keys("a", "b"), [4, 5])
    # A peer's read of a prompt whose third block is not held.
    tier.read_run([b"a", b"b", b"x"], [KvGroup("full_attention", 4)]).close()
    tier.evict(keys("c"))
    c = tier.counted()
    assert (c.held_bytes, c.stored_blocks, c.stored_bytes, c.loaded_blocks, c.loaded_bytes, c.served_blocks) == (
        2 * bb, 3, 3 * bb, 2, 2 * bb, 2)
    assert c.load_seconds > 0


def test_evicted_blocks_are_gone_and_a_load_of_one_names_it():
    caches = source_caches(LAYOUTS["cpu"][0](P_BLOCKS))
    tier = HostTier(PagedKv(caches, dict.fromkeys(LAYERS, 0), P_BLOCKS))
    tier.store(keys("a", "b"), [1, 2])
    tier.evict(keys("a", "zz"))
    assert keys("a")[0] not in tier and keys("b")[0] in tier and tier.nbytes == tier.block_bytes(0)
    with pytest.raises(KeyError, match="no bytes for 1 of the 2 blocks to load .first: group 0, hash 61"):
        tier.load(keys("a", "b"), [3, 4])


def test_one_call_moves_one_groups_blocks_one_key_each():
    caches = source_caches(LAYOUTS["cpu"][0](P_BLOCKS))
    tier = HostTier(PagedKv(caches, {LAYERS[0]: 0, LAYERS[1]: 1}, P_BLOCKS))
    with pytest.raises(ValueError, match="one key per block"):
        tier.store(keys("a"), [1, 2])
    with pytest.raises(ValueError, match=r"groups \[0, 1\]: one call moves one group's"):
        tier.store(keys("a") + keys("b", group=1), [1, 2])
    tier.store(keys("a", group=1), [3])  # a group holds its own layers only
    assert tier.block_bytes(1) == tier.block_bytes(0) and tier.nbytes == tier.block_bytes(1)


def test_a_pooled_run_of_a_hybrid_model_holds_its_window_groups_window_before_its_end():
    """Group 0 a sliding window of 5 tokens in blocks of 4, group 1 full attention: a run of E
    blocks needs group 1's blocks 0..E-1 and group 0's blocks of tokens [4E - 4, 4E): block E-1."""
    caches = source_caches(LAYOUTS["cpu"][0](P_BLOCKS))
    tier = HostTier(PagedKv(caches, {LAYERS[0]: 0, LAYERS[1]: 1}, P_BLOCKS))
    tier.store(keys("a", "b", "c", group=1), [1, 2, 3])
    tier.store(keys("c", group=0), [4])  # what the window still held when the request ended
    groups = (KvGroup("sliding_window", 4, 5), KvGroup("full_attention", 4))
    run = tier.read_run([b"a", b"b", b"c", b"d"], groups)
    assert run.num_tokens == 12 and run.keys == {0: {2: (0, b"c")}, 1: {i: (1, h) for i, h in enumerate([b"a", b"b", b"c"])}}
    assert torch.equal(run.gather(LAYERS[0], 0, [2])[0], caches[LAYERS[0]][4])
    with pytest.raises(KeyError, match="group 0's blocks 2-2, not 1"):
        run.gather(LAYERS[0], 0, [1])
    tier.evict(keys("c", group=0))
    assert (0, b"c") not in tier  # evicted while pinned: freed when the read ends
    run.close()
    # Without the window's block no end is held: no run (group 1 alone would be three).
    assert tier.read_run([b"a", b"b", b"c"], groups).num_tokens == 0


def tier_worker(caches):
    """P's connector worker with only its host tier (no KV server, no sources)."""
    from pdcluster.transfer.connector_meta import ConnectorSettings
    from pdcluster.transfer.connector_worker import _Worker

    worker = object.__new__(_Worker)
    worker.sources, worker.fetcher, worker._timings, worker._error_blocks = None, None, {}, set()
    worker.tier = HostTier(PagedKv(caches, dict.fromkeys(LAYERS, 0), P_BLOCKS))
    worker._tier_lost, worker._tier_failed, worker._tier_freed, worker._tier_loads = [], [], set(), {}
    worker.load_times = None
    worker.settings = ConnectorSettings(break_prefix="fault-")
    return worker


def test_the_worker_carries_out_orders_in_order_and_a_failed_load_fails_its_blocks():
    from pdcluster.transfer.connector_meta import PdcMetadata
    from pdcluster.transfer.tier_scheduler import TierCopy, TierOrders

    caches = source_caches(LAYOUTS["cpu"][0](P_BLOCKS))
    worker = tier_worker(caches)
    worker.start(PdcMetadata(tier=TierOrders([
        TierCopy("store", 0, (b"a", b"b"), (1, 2), "r1"),
        TierCopy("evict", 0, (b"a",)),
        TierCopy("load", 0, (b"a", b"b"), (5, 6), "r2"),  # a's bytes are gone (the book out of step): it fails
        TierCopy("load", 0, (b"b",), (7,), "r3"),
    ], free_after=["r1"])))
    want = source_caches(LAYOUTS["cpu"][0](P_BLOCKS))
    assert all(torch.equal(caches[n][7], want[n][2]) for n in LAYERS)  # r3's load ran after r2's failed
    assert worker.take_error_blocks() == {5, 6}  # vLLM recomputes them, or fails r2 (kv_load_failure_policy)
    report = worker.take_timings()
    assert report.tier_lost == ((0, b"a"),)  # the book forgets the block with no bytes, only it
    assert report.tier_failed == ("r2",)  # and r2's hit is no hit
    assert worker.results().finished_sending == {"r1"}  # stored: vLLM may free r1's blocks
    assert worker.results().finished_sending == set()
    worker.start(PdcMetadata(tier=TierOrders([TierCopy("load", 0, (b"b",), (8,), "fault-r4")])))  # injected
    assert worker.take_error_blocks() == {8} and worker.take_timings().tier_failed == ("fault-r4",)
    assert (0, b"b") in worker.tier  # the bytes are fine: only the load failed


def test_ds_worker_reports_each_requests_tier_load_and_its_report_carries_it():
    """D's worker times the loads of each request (before its pull starts: `start` runs the tier's
    orders first) and D's scheduler side puts them in the request's transfer report."""
    from vllm.v1.outputs import KVConnectorOutput

    from pdcluster.proto.messages import TransferStats
    from pdcluster.transfer.connector import PdcConnector
    from pdcluster.transfer.connector_loads import Loads
    from pdcluster.transfer.connector_meta import PdcMetadata
    from pdcluster.transfer.groups import GroupInfo
    from pdcluster.transfer.tier_scheduler import TierCopy, TierOrders, TierScheduler
    from pdcluster.transfer.vllm_compat import API

    worker = tier_worker(source_caches(LAYOUTS["cpu"][0](P_BLOCKS)))
    worker.fetcher = object()  # D's: it has a fetcher (no load job reaches it here)
    worker.tier.store([(0, b"a"), (0, b"b")], [1, 2])
    before = time.monotonic_ns()
    worker.start(PdcMetadata(tier=TierOrders([TierCopy("load", 0, (b"a",), (5,), "d1"),
                                              TierCopy("load", 0, (b"b",), (6,), "d1")])))
    timings = worker.take_timings()
    (start, end), = timings.tier_loads.values()
    assert list(timings.tier_loads) == ["d1"] and before <= start < end <= time.monotonic_ns()
    assert worker.take_timings() is None  # reported once

    conn = object.__new__(PdcConnector)
    full = GroupInfo(0, "full_attention", "FullAttentionSpec", 16, 0, 100)
    conn._tier = TierScheduler([full], 1000)
    conn._loads = Loads([full], conn._tier, failed_recving=API["0.32.0"].failed_recving)
    conn._loads.reports = {"d1": TransferStats(d_cached_tokens=256, d_tier_tokens=256)}
    conn.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=timings))
    report = conn._loads.reports["d1"]
    assert (report.d_tier_load_start_ns, report.d_tier_loaded_ns) == (start, end)


def test_p_s_worker_writes_each_prefills_load_time_under_its_transfer(tmp_path):
    from pdcluster.transfer.connector_meta import PdcMetadata, SourceStep
    from pdcluster.transfer.tier_load_times import LoadTimes
    from pdcluster.transfer.tier_scheduler import TierCopy, TierOrders

    worker = tier_worker(source_caches(LAYOUTS["cpu"][0](P_BLOCKS)))
    worker.load_times = LoadTimes(str(tmp_path / "tier-loads"))
    worker.start(PdcMetadata(tier=TierOrders([TierCopy("store", 0, (b"a",), (1,), "r0")])))
    worker.start(PdcMetadata(
        tier=TierOrders([TierCopy("load", 0, (b"a",), (4,), "r1"), TierCopy("load", 0, (b"zz",), (5,), "r2")]),
        steps=[SourceStep("t1", "r1", 300, ((4, 9),), 300), SourceStep("t2", "r2", 300, ((5, 9),), 300)]))
    actor_side = LoadTimes(str(tmp_path / "tier-loads"))  # the engine actor's end of the file
    assert actor_side.read("t1") > 0
    assert actor_side.read("t2") == 0  # its load failed: no time, and it is no tier hit
