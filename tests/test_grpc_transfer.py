"""P -> D block transfer over real gRPC on 127.0.0.1, with real torch KV tensors: the paged layouts,
D pulling and P pushing, the service's checks and faults. The P and D ends and their fixtures
are in tests/transfer_fakes.py; the torch.distributed data plane's tests in test_dist_transfer.py."""

from __future__ import annotations

import logging
import socket
import time

import grpc
import pytest
import torch
from transfer_fakes import (
    BLOCK_SIZE,
    D_BLOCKS,
    GROUPS,
    LAYERS,
    LAYOUTS,
    P_BLOCKS,
    SECRET,
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

from pdcluster.transfer import frames
from pdcluster.transfer import kv_transfer_pb2 as pb
from pdcluster.transfer.auth import GrpcAuth
from pdcluster.transfer.grpc_client import LoadJob, LoadResults, TransferError
from pdcluster.transfer.grpc_server import KvServer, chunk_runs
from pdcluster.transfer.paged_kv import PagedKv
from pdcluster.transfer.plan import GroupPlan, TransferPlan
from pdcluster.transfer.sources import SourceTable

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
    time.sleep(0.1)  # D is waiting on P now

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
    time.sleep(0.2)  # waiting for a P that never runs the request
    t0 = time.monotonic()
    d.fetcher.cancel("d-r1")

    r = wait_results(d.fetcher, {"d-r1"}, timeout=3.0)
    assert r.finished == {"d-r1"} and r.failed == {"d-r1"}
    assert time.monotonic() - t0 < 2.0
    d.fetcher.cancel("d-r1")  # after the end: nothing happens


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


# ---------------------------------------------------------------- the service, through the stub


@pytest.mark.parametrize("groups, code", [
    ([pb.GroupBlocks(group=0, block_indices=[2, 4])], grpc.StatusCode.OUT_OF_RANGE),  # 4 blocks in the prompt
    ([pb.GroupBlocks(group=0, block_indices=[3, 1])], grpc.StatusCode.OUT_OF_RANGE),  # not ascending
    ([pb.GroupBlocks(group=1, block_indices=[2])], grpc.StatusCode.INVALID_ARGUMENT),  # no group 1
])
def test_read_outside_the_prompt_is_refused(make_p, stub_to, groups, code):
    p = make_p()
    offer(p, "r1", (2, 5, 7, 9))
    with pytest.raises(grpc.RpcError) as err:
        list(stub_to(p.server.address).ReadBlocks(pb.ReadBlocksRequest(transfer_id="r1", groups=groups),
                                                  timeout=TIMEOUT_S))
    assert err.value.code() == code
    # The refused read unpinned the source: once released, it is reported.
    p.sources.release("r1")
    assert p.sources.take_finished() == {"r1"}


def test_read_of_a_freed_window_block_is_refused(make_p, stub_to):
    p = make_p()
    offer(p, "r1", (0, 0, 7, 9))  # blocks 0, 1 left the window: vLLM's null block
    with pytest.raises(grpc.RpcError) as err:
        list(stub_to(p.server.address).ReadBlocks(pb.ReadBlocksRequest(
            transfer_id="r1", groups=[pb.GroupBlocks(group=0, block_indices=[1, 2])]), timeout=TIMEOUT_S))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_read_unknown_transfer_is_not_found(make_p, stub_to):
    p = make_p()
    with pytest.raises(grpc.RpcError) as err:
        list(stub_to(p.server.address).ReadBlocks(pb.ReadBlocksRequest(
            transfer_id="nobody", groups=[pb.GroupBlocks(group=0, block_indices=[0])]), timeout=TIMEOUT_S))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no transfer nobody" in err.value.details()


def test_get_layout_and_release(make_p, stub_to):
    p = make_p()
    stub = stub_to(p.server.address)
    layout = stub.GetLayout(pb.LayoutRequest(), timeout=TIMEOUT_S)
    assert layout.engine_id == "p0"
    assert [(l.name, l.group, list(l.block_shape), l.dtype) for l in layout.layers] == [
        (name, 0, [2, 16, 32], "float32") for name in LAYERS]

    offer(p, "r1", (2,))
    assert stub.Release(pb.ReleaseRequest(transfer_id="r1"), timeout=TIMEOUT_S).known is True
    assert stub.Release(pb.ReleaseRequest(transfer_id="r1"), timeout=TIMEOUT_S).known is False
    assert p.sources.take_finished() == {"r1"}


def test_callers_without_the_secret_read_nothing_release_nothing_and_p_serves_on(make_p, make_d, stub_to,
                                                                                 tmp_path, caplog):
    """A peer that reaches P's port: no token, another cluster's, a replayed one, raw bytes, a
    pickle. Each is refused before P reads a block or its lease; D then reads as ever."""
    from e2e import evil_pickle

    from pdcluster.transfer.auth import AUTH_METADATA_KEY

    p = make_p()
    offer(p, "r1", (2, 5, 7, 9))
    gathered = []
    real_gather = p.kv.gather
    p.kv.gather = lambda layer, ids: (gathered.append(ids), real_gather(layer, ids))[1]
    read = pb.ReadBlocksRequest(transfer_id="r1", groups=[pb.GroupBlocks(group=0, block_indices=[0, 1, 2, 3])])
    for secret in (None, "another-clusters-secret"):
        stub = stub_to(p.server.address, secret)
        for call in (lambda: list(stub.ReadBlocks(read, timeout=5)),
                     lambda: stub.Release(pb.ReleaseRequest(transfer_id="r1"), timeout=5),
                     lambda: stub.GetLayout(pb.LayoutRequest(), timeout=5)):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value
    # A token seen once does not open a second call.
    auth = GrpcAuth(SECRET)
    token = auth.token("/pdcluster.transfer.KvTransfer/Release")
    raw = grpc.insecure_channel(p.server.address)
    release = raw.unary_unary("/pdcluster.transfer.KvTransfer/Release",
                              request_serializer=pb.ReleaseRequest.SerializeToString,
                              response_deserializer=pb.ReleaseReply.FromString)
    assert release(pb.ReleaseRequest(transfer_id="nope"), metadata=[(AUTH_METADATA_KEY, token)], timeout=5).known is False
    with pytest.raises(grpc.RpcError, match="replayed"):
        release(pb.ReleaseRequest(transfer_id="r1"), metadata=[(AUTH_METADATA_KEY, token)], timeout=5)
    # A pickle as the request body of a call without a token: refused before any deserializer.
    marker = tmp_path / "ran"
    evil = raw.unary_unary("/pdcluster.transfer.KvTransfer/Release")
    with pytest.raises(grpc.RpcError):
        evil(evil_pickle(marker), timeout=5)
    raw.close()
    # Raw garbage on the port: not HTTP/2, the connection is dropped.
    host, port = p.server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as junk:
        junk.sendall(b"\x80\x05garbage that is not an HTTP/2 preface" * 10)
        junk.settimeout(5)
        try:
            while junk.recv(4096):
                pass
        except OSError:
            pass
    assert gathered == [] and not marker.exists()
    assert "refused /pdcluster.transfer.KvTransfer/ReadBlocks" in caplog.text
    d = make_d()
    d.fetcher.submit(make_job(p.server.address, (0, 1, 2, 3), (1, 2, 3, 4)))
    r = wait_results(d.fetcher, {"d-r1"})
    assert (r.finished, r.failed) == ({"d-r1"}, set())  # the lease was still there


def test_injected_fault_breaks_the_transfer_halfway(make_d):
    """P's fault injection: a transfer whose id has the prefix dies after half its blocks;
    D has written some blocks, reports failure (vLLM then errors or recomputes the request)."""
    caches = source_caches(cpu_shape(P_BLOCKS))
    sources = SourceTable(GROUPS, (BLOCK_SIZE,))
    server = KvServer("p0", PagedKv(caches, GROUPS, P_BLOCKS), sources, "127.0.0.1", 0, 1 << 20, secret=SECRET,
                      break_prefix="break-")
    try:
        d = make_d()
        writes = []
        real_write = d.kv.write
        d.kv.write = lambda layer, ids, data: (writes.append(layer), real_write(layer, ids, data))
        for tid in ("break-1", "ok-1"):
            sources.step(tid, tid, 4 * BLOCK_SIZE, ((2, 5, 7, 9),), 4 * BLOCK_SIZE)
            sources.step_done()
            sources.finish(tid, 60)
        d.fetcher.submit(make_job(server.address, (0, 1, 2, 3), (0, 1, 2, 3), transfer_id="break-1"))
        r = wait_results(d.fetcher, {"d-break-1"})
        assert r.failed == {"d-break-1"} and writes == [LAYERS[0]]  # layer 0 arrived, layer 1 never did
        d.fetcher.submit(make_job(server.address, (0, 1, 2, 3), (4, 5, 6, 7), transfer_id="ok-1"))
        r = wait_results(d.fetcher, {"d-ok-1"})
        assert r.finished == {"d-ok-1"} and r.failed == set()
        assert released(sources, {"break-1", "ok-1"}) == {"break-1", "ok-1"}  # both released: nothing leaks on P
    finally:
        server.stop()


def test_server_reads_ahead_of_a_stalled_reader_only_a_bounded_amount(stub_to):
    """Flow control: P copies blocks out only as fast as D drains the stream. With D
    stalled after one chunk, P has read a few chunks (HTTP/2 window), not the 64 MiB."""
    n, shape = 65, (2, 128, 1024)  # 1 MiB blocks (float32); block 0 is the null block
    caches = {LAYERS[0]: torch.zeros(n, *shape)}
    kv = PagedKv(caches, {LAYERS[0]: 0}, n)
    reads = []
    real_byte_runs = kv.byte_runs  # how P reads blocks into a frame
    kv.byte_runs = lambda layer, ids: (reads.append(len(ids)), real_byte_runs(layer, ids))[1]
    sources = SourceTable({LAYERS[0]: 0}, (BLOCK_SIZE,))
    sources.step("big", "big", 64 * BLOCK_SIZE, (tuple(range(1, n)),), 64 * BLOCK_SIZE)
    sources.step_done()
    sources.finish("big", 60)
    server = KvServer("p0", kv, sources, "127.0.0.1", 0, 1 << 20, secret=SECRET)
    try:
        stream = stub_to(server.address).ReadBlocks(pb.ReadBlocksRequest(
            transfer_id="big", groups=[pb.GroupBlocks(group=0, block_indices=list(range(64)))]), timeout=30)
        first = next(stream)
        assert first.chunk.count == 1
        time.sleep(1.0)  # D stalls: P may only fill the transport's window
        ahead = sum(reads)
        assert ahead <= 24, f"P read {ahead} MiB ahead of a stalled reader"
        assert sum(c.chunk.count for c in stream) == 63  # and the rest still arrives, in full
        assert sum(reads) == 64
    finally:
        server.stop()


def test_p_without_channels_refuses_a_channel_open(make_p, stub_to):
    p = make_p()
    with pytest.raises(grpc.RpcError) as err:
        stub_to(p.server.address).OpenChannel(pb.OpenChannelRequest(name="x"), timeout=TIMEOUT_S)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "transfer.backend" in err.value.details()


def test_frame_round_trip_keeps_header_and_bytes():
    blocks = torch.arange(24, dtype=torch.float32).view(2, 3, 4)
    f = frames.decode(frames.encode(pb.KvChunk(layer="l", group=1, first=2, count=2, tag=9), blocks))
    assert (f.chunk.layer, f.chunk.group, f.chunk.first, f.chunk.count, f.chunk.tag) == ("l", 1, 2, 2, 9)
    assert bytes(f.data) == blocks.numpy().tobytes()
    assert len(frames.decode(frames.encode(pb.KvChunk(layer="l"))).data) == 0
