"""P's KV service (transfer/grpc_server.py) called directly: reads it refuses, callers without the
secret, an injected fault, read-ahead of a stalled reader, channel opens, frames."""

from __future__ import annotations

import socket
import time

import grpc
import pytest
import torch
from transfer_fakes import (
    BLOCK_SIZE,
    GROUPS,
    LAYERS,
    P_BLOCKS,
    SECRET,
    TIMEOUT_S,
    cpu_shape,
    make_job,
    offer,
    released,
    source_caches,
    wait_results,
)

from pdcluster.transfer import frames
from pdcluster.transfer import kv_transfer_pb2 as pb
from pdcluster.transfer.grpc_auth import GrpcAuth
from pdcluster.transfer.grpc_server import KvServer
from pdcluster.transfer.paged_kv import PagedKv
from pdcluster.transfer.sources import SourceTable

# ---------------------------------------------------------------- chunk_runs


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

    from pdcluster.transfer.grpc_auth import AUTH_METADATA_KEY

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
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED, err.value
    # A token seen once does not open a second call.
    auth = GrpcAuth(SECRET)
    token = auth.token("/pdcluster.transfer.KvTransfer/Release", "p0",
                       pb.ReleaseRequest(transfer_id="nope").SerializeToString())
    raw = grpc.insecure_channel(p.server.address)
    release = raw.unary_unary("/pdcluster.transfer.KvTransfer/Release",
                              request_serializer=pb.ReleaseRequest.SerializeToString,
                              response_deserializer=pb.ReleaseReply.FromString)
    assert release(pb.ReleaseRequest(transfer_id="nope"), metadata=[(AUTH_METADATA_KEY, token)], timeout=5).known is False
    with pytest.raises(grpc.RpcError) as err:  # refused as a stranger is (P's log names the replay)
        release(pb.ReleaseRequest(transfer_id="r1"), metadata=[(AUTH_METADATA_KEY, token)], timeout=5)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
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
    # Eight refusals, one line (a flood costs no line per attempt): the first, at once.
    [line] = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert "refused 1 call(s) since the last such line (latest: /pdcluster.transfer.KvTransfer/ReadBlocks" in line
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
    stalled after one chunk, P has read what the transport's windows and buffers take (a few
    chunks; 36 MiB once in a clean clone's unit run, under load), not the 160 MiB."""
    n, shape = 161, (2, 128, 1024)  # 1 MiB blocks (float32); block 0 is the null block
    caches = {LAYERS[0]: torch.zeros(n, *shape)}
    kv = PagedKv(caches, {LAYERS[0]: 0}, n)
    reads = []
    real_byte_runs = kv.byte_runs  # how P reads blocks into a frame
    kv.byte_runs = lambda layer, ids: (reads.append(len(ids)), real_byte_runs(layer, ids))[1]
    sources = SourceTable({LAYERS[0]: 0}, (BLOCK_SIZE,))
    sources.step("big", "big", (n - 1) * BLOCK_SIZE, (tuple(range(1, n)),), (n - 1) * BLOCK_SIZE)
    sources.step_done()
    sources.finish("big", 60)
    server = KvServer("p0", kv, sources, "127.0.0.1", 0, 1 << 20, secret=SECRET)
    try:
        stream = stub_to(server.address).ReadBlocks(pb.ReadBlocksRequest(
            transfer_id="big", groups=[pb.GroupBlocks(group=0, block_indices=list(range(n - 1)))]), timeout=30)
        first = next(stream)
        assert first.chunk.count == 1
        time.sleep(1.0)  # D stalls: P may only fill the transport's window
        ahead = sum(reads)
        assert ahead <= 64, f"P read {ahead} MiB ahead of a stalled reader"
        assert sum(c.chunk.count for c in stream) == n - 2  # and the rest still arrives, in full
        assert sum(reads) == n - 1
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


def test_idle_and_oversized_calls_without_the_secret_hold_nothing(make_p, stub_to):
    """Issue 26 item 1: a refused call waited in a pool thread for its request message, so one
    connection opening 68 calls that never sent it made every legitimate call time out; 60 MiB
    bodies were read in. Now a stranger's call is refused at its headers."""
    import threading

    p = make_p()
    raw = grpc.insecure_channel(p.server.address)
    never = threading.Event()

    def silent():  # the call's headers go out; its message never does
        never.wait(30)
        yield b""

    release = "/pdcluster.transfer.KvTransfer/Release"
    idle = [raw.stream_unary(release).future(silent(), timeout=30) for _ in range(100)]
    big = raw.unary_unary(release).future(b"\0" * (60 << 20), timeout=30)
    stub = stub_to(p.server.address)
    assert stub.GetLayout(pb.LayoutRequest(), timeout=5).engine_id == "p0"  # served at once
    assert stub.Release(pb.ReleaseRequest(transfer_id="nope"), timeout=5).known is False
    for call in [*idle, big]:  # each refused without its message
        assert call.exception(timeout=10).code() == grpc.StatusCode.UNIMPLEMENTED
    never.set()
    raw.close()


def test_a_pull_whose_connection_died_before_any_kv_came_is_tried_once_more(make_p, make_d, monkeypatch):
    """A ReadBlocks that ends UNAVAILABLE with nothing received (its connection died: a healed cut
    leaves one for dead) is tried once more on a new connection; twice, and the load fails naming why."""
    from pdcluster.transfer.grpc_server import KvTransferService

    p = make_p()
    real, calls = KvTransferService._read_blocks, []

    def dies_first(self, request, context):
        calls.append(request.transfer_id)
        if calls.count(request.transfer_id) <= (2 if request.transfer_id == "twice" else 1):
            context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")
        yield from real(self, request, context)
    monkeypatch.setattr(KvTransferService, "_read_blocks", dies_first)
    for tid in ("once", "twice"):
        offer(p, tid, (2, 5, 7, 9))
    d = make_d()
    d.fetcher.submit(make_job(p.server.address, (0, 1, 2, 3), (0, 1, 2, 3), transfer_id="once"))
    r = wait_results(d.fetcher, {"d-once"})
    assert (r.finished, r.failed, calls) == ({"d-once"}, set(), ["once", "once"])
    d.fetcher.submit(make_job(p.server.address, (0, 1, 2, 3), (4, 5, 6, 7), transfer_id="twice"))
    r = wait_results(d.fetcher, {"d-twice"})
    assert r.failed == {"d-twice"} and calls.count("twice") == 2
    assert r.timings["d-twice"].error == f"UNAVAILABLE from P at {p.server.address}: Socket closed"
