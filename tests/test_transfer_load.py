"""The KV transfer under load (issue 16 item 0): P's service bounds its streams and keeps threads
for the calls that end leases; D's fetch queue is bounded and a load's time counts from its
submission. Real gRPC on 127.0.0.1; the ends are tests/transfer_fakes.py's."""

from __future__ import annotations

import threading
import time
import types

import grpc
import pytest
from transfer_fakes import (
    BLOCK_SIZE,
    GROUPS,
    P_BLOCKS,
    SECRET,
    cpu_shape,
    make_job,
    offer,
    released,
    source_caches,
    wait_results,
)

from pdcluster.transfer import kv_transfer_pb2 as pb
from pdcluster.transfer.grpc_server import KvServer
from pdcluster.transfer.paged_kv import PagedKv
from pdcluster.transfer.sources import SourceTable


@pytest.fixture
def busy_p():
    """A P with 2 stream slots whose sources wait up to 5 s for a transfer it has not heard of."""
    sources = SourceTable(GROUPS, (BLOCK_SIZE,))
    server = KvServer("p0", PagedKv(source_caches(cpu_shape(P_BLOCKS)), GROUPS, P_BLOCKS), sources, "127.0.0.1", 0,
                      1 << 20, secret=SECRET, wait_s=5.0, max_streams=2)
    yield server, sources
    server.stop()


def read(stub, transfer_id, timeout=10):
    return list(stub.ReadBlocks(pb.ReadBlocksRequest(transfer_id=transfer_id, groups=[
        pb.GroupBlocks(group=0, block_indices=[0, 1])]), timeout=timeout))


def test_streams_waiting_through_ps_queue_leave_the_lease_calls_their_threads(busy_p, stub_to):
    server, sources = busy_p
    stub = stub_to(server.address)
    waiting = [threading.Thread(target=lambda t=t: read(stub, t)) for t in ("later-1", "later-2")]
    for t in waiting:
        t.start()
    time.sleep(0.3)  # both streams hold their threads, waiting for transfers P has not started
    offer_p = types.SimpleNamespace(sources=sources)
    offer(offer_p, "now", (2, 5))
    t0 = time.monotonic()
    assert stub.GetLayout(pb.LayoutRequest(), timeout=2).engine_id == "p0"
    assert stub.Release(pb.ReleaseRequest(transfer_id="now"), timeout=2).known is True
    assert time.monotonic() - t0 < 1.0, "a lease call waited behind the streams"
    with pytest.raises(grpc.RpcError) as err:  # a third stream: refused at once, not queued
        read(stub, "later-3")
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "2 transfer streams" in err.value.details()
    for tid in ("later-1", "later-2"):
        offer(offer_p, tid, (2, 5))
    for t in waiting:
        t.join(10)
        assert not t.is_alive()


def test_a_full_fetch_queue_fails_a_new_load_at_once_and_releases_its_lease(make_p, make_d):
    p = make_p()
    d = make_d(max_workers=1)
    d.fetcher._max_waiting = 1
    # The first load holds the one thread (P has not started it: it waits), the second waits for it.
    d.fetcher.submit(make_job(p.server.address, (0, 1), (0, 1), transfer_id="slow", num_blocks=2))
    time.sleep(0.1)  # its thread has taken it
    d.fetcher.submit(make_job(p.server.address, (0, 1), (0, 1), transfer_id="queued", num_blocks=2))
    offer(p, "refused", (2, 5))
    t0 = time.monotonic()
    d.fetcher.submit(make_job(p.server.address, (0, 1), (2, 3), transfer_id="refused", num_blocks=2))
    r = wait_results(d.fetcher, {"d-refused"}, timeout=2)
    assert r.failed == {"d-refused"} and time.monotonic() - t0 < 1.0
    assert released(p.sources, {"refused"}, timeout=2) == {"refused"}  # P's blocks free now, not after lease_s
