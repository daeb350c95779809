"""P -> D block transfer over real gRPC on 127.0.0.1, with real torch KV tensors: the paged layouts,
D pulling and P pushing, the service's checks and faults. The P and D ends and their fixtures
are in tests/transfer_fakes.py; the torch.distributed data plane's tests in test_dist_transfer.py."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from transfer_fakes import (
    BLOCK_SIZE,
    D_BLOCKS,
    LAYERS,
    LAYOUTS,
    P_BLOCKS,
    TIMEOUT_S,
    assert_zero_except,
    block,
    cpu_shape,
    free_port,
    make_handle,
    make_job,
    make_plan,
    offer,
    released,
    source_caches,
    wait_results,
    wait_until_true,
    zero_caches,
)

from pdcluster.transfer import kv_transfer_pb2 as pb
from pdcluster.transfer.grpc_client import LoadJob, LoadResults, TransferError
from pdcluster.transfer.grpc_server import chunk_runs
from pdcluster.transfer.plan import GroupPlan, TransferPlan

# ---------------------------------------------------------------- chunk_runs


@pytest.mark.parametrize("num_blocks, block_bytes, chunk_bytes, runs", [
    (5, 4096, 2 * 4096 + 1, [(0, 2), (2, 2), (4, 1)]),
    (4, 4096, 2 * 4096, [(0, 2), (2, 2)]),
    (3, 4096, 100, [(0, 1), (1, 1), (2, 1)]),  # smaller than a block: still one block per run
    (4, 10, 1000, [(0, 4)]),
    (0, 4096, 4096, []),
])
def test_chunk_runs(num_blocks, block_bytes, chunk_bytes, runs):
    assert chunk_runs(num_blocks, block_bytes, chunk_bytes) == runs


# ---------------------------------------------------------------- pulls of finished prefills


@pytest.mark.parametrize("layout", ["cpu", "flash"])
def test_pull_copies_planned_blocks_exactly(make_p, make_d, layout):
    p, d = make_p(layout), make_d(layout)
    offer(p, "r1", (2, 5, 7, 9))
    remote, local = (0, 1, 3), (0, 15, 4)  # P blocks 2, 5, 9
    d.fetcher.submit(make_job(p.server.address, remote, local))

    r = wait_results(d.fetcher, {"d-r1"})
    assert r.finished == {"d-r1"} and r.failed == set()
    for name in LAYERS:
        for pb_id, lb in zip((2, 5, 9), local):
            assert torch.equal(block(d.caches[name], d.block_dim, lb), block(p.caches[name], p.block_dim, pb_id)), \
                f"{name}: D block {lb} != P block {pb_id}"
    assert_zero_except(d.caches, d.block_dim, D_BLOCKS, written=local)
    # The source is untouched, and released once the pull was done.
    assert torch.equal(p.caches[LAYERS[0]], source_caches(LAYOUTS[layout][0](P_BLOCKS))[LAYERS[0]])
    assert p.sources.take_finished() == {"r1"}
    assert d.fetcher.take_results() == LoadResults()  # reported once


def test_pull_in_many_chunks_is_exact(make_p, make_d, monkeypatch):
    block_bytes = 2 * 16 * 32 * 4
    p, d = make_p("cpu", chunk_bytes=2 * block_bytes + 1), make_d("cpu")
    table = (1, 3, 4, 6, 8, 11)
    offer(p, "r1", table)
    writes = []
    real_write = d.kv.write
    monkeypatch.setattr(d.kv, "write", lambda layer, ids, data: (writes.append((layer, list(ids))),
                                                                  real_write(layer, ids, data)))
    remote, local = (0, 1, 3, 4, 5), (2, 3, 4, 5, 6)
    d.fetcher.submit(make_job(p.server.address, remote, local, num_blocks=len(table)))

    r = wait_results(d.fetcher, {"d-r1"})
    assert r.finished == {"d-r1"} and r.failed == set()
    # 5 blocks in runs of at most 2, per layer.
    assert sorted(writes) == sorted((name, ids) for name in LAYERS for ids in ([2, 3], [4, 5], [6]))
    for name in LAYERS:
        for i, lb in zip(remote, local):
            assert torch.equal(d.caches[name][lb], p.caches[name][table[i]])
    assert_zero_except(d.caches, 0, D_BLOCKS, written=local)
    assert p.sources.take_finished() == {"r1"}


def test_read_blocks_stream_chunks(make_p, stub_to):
    block_bytes = 2 * 16 * 32 * 4
    p = make_p("cpu", chunk_bytes=2 * block_bytes)
    offer(p, "r1", (6, 1, 2, 3, 4))
    chunks = list(stub_to(p.server.address).ReadBlocks(pb.ReadBlocksRequest(
        transfer_id="r1", groups=[pb.GroupBlocks(group=0, block_indices=[0, 3, 4])]), timeout=TIMEOUT_S))
    assert [(c.chunk.layer, c.chunk.group, c.chunk.first, c.chunk.count) for c in chunks] == [
        (LAYERS[0], 0, 0, 2), (LAYERS[0], 0, 2, 1), (LAYERS[1], 0, 0, 2), (LAYERS[1], 0, 2, 1)]
    assert bytes(chunks[2].data) == torch.stack([p.caches[LAYERS[1]][6], p.caches[LAYERS[1]][3]]).numpy().tobytes()
    # A read pins and unpins: the source stays live until released.
    assert p.sources.take_finished() == set()


def test_pull_of_unknown_transfer_fails_and_writes_nothing(make_p, make_d):
    p, d = make_p(), make_d(timeout_s=0.5)
    t0 = time.monotonic()
    d.fetcher.submit(make_job(p.server.address, (0, 1), (0, 1), transfer_id="ghost"))

    r = wait_results(d.fetcher, {"d-ghost"}, timeout=2.0)
    assert r.finished == {"d-ghost"} and r.failed == {"d-ghost"}
    assert time.monotonic() - t0 < 2.0
    assert_zero_except(d.caches, 0, D_BLOCKS)
    assert p.sources.take_finished() == set() and len(p.sources) == 0


def test_pull_from_dead_address_fails_within_timeout(make_d):
    d = make_d(timeout_s=1.0)
    address = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    d.fetcher.submit(make_job(address, (0, 1), (0, 1)))

    r = wait_results(d.fetcher, {"d-r1"}, timeout=3.0)
    assert r.finished == {"d-r1"} and r.failed == {"d-r1"}
    assert time.monotonic() - t0 < 3.0
    assert_zero_except(d.caches, 0, D_BLOCKS)


@pytest.mark.parametrize("plan", [
    TransferPlan((), d_cached_tokens=64, transferred_tokens=0),  # what the connector builds
    TransferPlan((GroupPlan(0, "full_attention", (), ()),), d_cached_tokens=64, transferred_tokens=0),
])
def test_job_without_blocks_only_releases(make_p, make_d, plan):
    p = make_p()
    d = make_d(max_workers=1)  # jobs run in order: the second one's result means the first is done
    offer(p, "r1", (2, 5, 7, 9))
    offer(p, "r2", (1, 3))
    d.fetcher.submit(LoadJob("d-r1", make_handle(p.server.address), plan))
    d.fetcher.submit(make_job(p.server.address, (1,), (8,), transfer_id="r2", num_blocks=2))

    r = wait_results(d.fetcher, {"d-r2"})
    assert r.finished == {"d-r2"} and r.failed == set()  # nothing reported for d-r1
    assert p.sources.take_finished() == {"r1", "r2"}
    assert_zero_except(d.caches, 0, D_BLOCKS, written=(8,))


@pytest.mark.parametrize("d_shape, d_dtype", [
    (cpu_shape(D_BLOCKS, (2, 16, 16)), torch.float32),  # different block shape
    (cpu_shape(D_BLOCKS), torch.float16),  # different dtype
])
def test_layout_mismatch_fails(make_p, make_d, stub_to, caplog, d_shape, d_dtype):
    p = make_p()
    d = make_d(caches=zero_caches(d_shape, d_dtype))
    offer(p, "r1", (2, 5, 7, 9))
    handle = make_handle(p.server.address)

    with pytest.raises(TransferError, match="different KV layout"):
        d.fetcher._check_peer(stub_to(p.server.address), handle, time.monotonic() + TIMEOUT_S)

    with caplog.at_level(logging.ERROR, logger="pdcluster.transfer.grpc_client"):
        d.fetcher.submit(LoadJob("d-r1", handle, make_plan((0, 1), (0, 1))))
        r = wait_results(d.fetcher, {"d-r1"})
    assert r.finished == {"d-r1"} and r.failed == {"d-r1"}
    assert any("d-r1" in m and "different KV layout" in m for m in caplog.messages)
    assert_zero_except(d.caches, 0, D_BLOCKS)
    assert released(p.sources, {"r1"}) == {"r1"}  # released even though nothing was read


# ---------------------------------------------------------------- push: D asks while P computes


def test_push_streams_layers_as_the_forward_pass_writes_them(make_p, make_d):
    """D asks before P has run the request; P computes it in two steps, layer by
    layer; D ends with exactly P's blocks, and got layer 0 of step 1 before P's
    step 2 existed."""
    p, d = make_p(), make_d(timeout_s=5.0)
    table, local = (2, 5, 7, 9), (0, 15, 4, 3)
    writes = []
    real_write = d.kv.write
    d.kv.write = lambda layer, ids, data: (writes.append((layer, list(ids))), real_write(layer, ids, data))
    d.fetcher.submit(make_job(p.server.address, (0, 1, 2, 3), local))
    wait_until_true(lambda: p.sources.waiting == 1)  # D is waiting on P now

    # Step 1 computes tokens [0, 2.5 blocks): blocks 0 and 1 complete.
    p.sources.step("r1", "r1", 4 * BLOCK_SIZE, ((2, 5, 7),), int(2.5 * BLOCK_SIZE))
    p.sources.layer_done(LAYERS[0])
    wait_until_true(lambda: (LAYERS[0], [0, 15]) in writes)
    assert not any(layer == LAYERS[1] for layer, _ in writes), "layer 1 sent before its forward pass"
    p.sources.layer_done(LAYERS[1])
    p.sources.step_done()
    # Step 2 finishes the prompt (block 3 joins the table).
    p.sources.step("r1", "r1", 4 * BLOCK_SIZE, (table,), 4 * BLOCK_SIZE)
    p.sources.step_done()
    p.sources.finish("r1", lease_s=60)

    r = wait_results(d.fetcher, {"d-r1"}, timeout=5.0)
    assert r.finished == {"d-r1"} and r.failed == set()
    for name in LAYERS:
        for pb_id, lb in zip(table, local):
            assert torch.equal(d.caches[name][lb], p.caches[name][pb_id])
    assert writes[0] == (LAYERS[0], [0, 15])
    for name in LAYERS:  # every block once (runs may merge when the server wakes late)
        assert sorted(b for layer, ids in writes if layer == name for b in ids) == sorted(local)
    assert p.sources.take_finished() == {"r1"}


def test_push_aborted_prefill_fails_the_load(make_p, make_d):
    p, d = make_p(), make_d(timeout_s=5.0)
    d.fetcher.submit(make_job(p.server.address, (0, 1, 2, 3), (0, 1, 2, 3)))
    p.sources.step("r1", "r1", 4 * BLOCK_SIZE, ((2, 5),), 2 * BLOCK_SIZE)
    p.sources.step_done()
    t0 = time.monotonic()
    p.sources.finish("r1", lease_s=60, aborted=True)

    r = wait_results(d.fetcher, {"d-r1"}, timeout=3.0)
    assert r.finished == {"d-r1"} and r.failed == {"d-r1"}
    assert time.monotonic() - t0 < 2.0
    assert p.sources.take_finished() == {"r1"}


def test_cancelled_load_stops_waiting_for_p(make_p, make_d):
    p, d = make_p(), make_d(timeout_s=30.0)
    d.fetcher.submit(make_job(p.server.address, (0, 1), (0, 1), num_blocks=2))
    wait_until_true(lambda: p.sources.waiting == 1)  # waiting for a P that never runs the request
    t0 = time.monotonic()
    d.fetcher.cancel("d-r1")

    r = wait_results(d.fetcher, {"d-r1"}, timeout=3.0)
    assert r.finished == {"d-r1"} and r.failed == {"d-r1"}
    assert time.monotonic() - t0 < 2.0
    d.fetcher.cancel("d-r1")  # after the end: nothing happens


def test_stop_ends_a_running_load_before_closing_its_channel(make_p, make_d):
    p, d = make_p(), make_d(timeout_s=30.0)
    d.fetcher.submit(make_job(p.server.address, (0, 1), (0, 1), num_blocks=2))
    wait_until_true(lambda: p.sources.waiting == 1)
    t0 = time.monotonic()
    d.fetcher.stop()

    assert time.monotonic() - t0 < 2.0  # the call was cancelled, not waited out
    r = d.fetcher.take_results()
    assert r.finished == {"d-r1"} and r.failed == {"d-r1"}  # ended and reported before the close


def test_preemption_waits_for_a_copy_then_resets_progress(make_p):
    p = make_p()
    offer(p, "r1", (2, 5, 7, 9), ready_tokens=4 * BLOCK_SIZE)
    src = p.sources.acquire("r1", 0)
    assert src.ready_blocks(LAYERS[0], 0) == 4
    with src.copy_lock:
        done = []
        import threading

        t = threading.Thread(target=lambda: (p.sources.preempted("r1"), done.append(1)))
        t.start()
        time.sleep(0.05)
        assert not done, "preemption did not wait for the copy in progress"
    t.join(1)
    assert done and src.ready_blocks(LAYERS[0], 0) == 0 and src.block_ids == ()
    p.sources.unpin(src)
