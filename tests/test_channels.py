"""Both ends' bookkeeping of the data channels (transfer/channels.py): D's pool of one channel
per P, P's host of the channels D's opened, against a real KV service in this process."""

from __future__ import annotations

import time
from concurrent import futures

import pytest
import torch
from e2e import wait_until
from test_dist_channel import KEY, SECRET, SERVER, kv_service

from pdcluster.transfer.channels import ChannelPool
from pdcluster.transfer.dist_channel import ChannelError
from pdcluster.transfer.grpc_auth import GrpcAuth
from pdcluster.transfer.grpc_client import kv_stub


def assert_pair_carries(p_end, d_end, tag: int) -> None:
    """P's end of a pair sends a tensor under `tag`; D's end receives exactly it."""
    got = torch.zeros(4)
    pending = d_end.recv_async(got, tag)
    p_end.send(torch.arange(4, dtype=torch.float32), tag)
    pending.wait()
    assert torch.equal(got, torch.arange(4, dtype=torch.float32))


def test_a_kv_service_call_without_the_secret_opens_no_channel():
    import grpc

    server = kv_service(2.0)
    try:
        _, stub = kv_stub(server.address, GrpcAuth("another-cluster-secret"), SERVER)
        with pytest.raises(ChannelError, match="UNIMPLEMENTED: refused the call: it does not take this cluster's secret"):
            ChannelPool("d-test", 2.0, KEY).get(server.address, stub)
        assert server._channels.opened() == []
        with pytest.raises(grpc.RpcError) as err:  # nor reads its store
            from pdcluster.transfer import kv_transfer_pb2 as pb

            stub.ChannelStore(pb.StoreRequest(channel="x", op="get", key="k"), timeout=2)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        server.stop()


def test_the_pool_replaces_a_channel_whose_peer_is_gone():
    """E.g. its liveness connection timed out while the link to P was cut: the next transfer to that
    P gets a new pair instead of failing on the dead one. In one process: P's KV service here."""
    server = kv_service(5.0)
    try:
        _, stub = kv_stub(server.address, GrpcAuth(SECRET), SERVER)
        pool = ChannelPool("d-test", 5.0, KEY)
        first = pool.get(server.address, stub)
        assert pool.get(server.address, stub) is first and first.unusable is None
        server._channels.drop(server._channels.opened()[0])  # P's end goes: D's watcher sees it
        wait_until(lambda: first.unusable is not None, 5, interval=0.01, what="D noticing its peer leave")
        assert "P (rank 0) closed the channel" in first.unusable
        second = pool.get(server.address, stub)
        assert second is not first and second.name != first.name and first.unusable == "closed"
        assert_pair_carries(server._channels.get(server._channels.opened()[0]), second, 7)
        pool.close()
    finally:
        server.stop()


def test_a_restarted_d_opens_on_its_first_try_and_p_frees_the_old_d_s_channel():
    """Issue 26 item 6: D named its channels `address/engine_id/n` from n = 0 in every process,
    so after a restart P answered "opened twice" for each name the old D had used, and P never
    dropped a dead D's channels."""
    server = kv_service(5.0)
    try:
        _, stub = kv_stub(server.address, GrpcAuth(SECRET), SERVER)
        old_d = ChannelPool("d-test", 5.0, KEY)
        first = old_d.get(server.address, stub)
        # The D restarts: a new process, the same engine id; the old one's end is never closed.
        new_d = ChannelPool("d-test", 5.0, KEY)
        second = new_d.get(server.address, stub)
        assert second.name != first.name
        assert server._channels.opened() == [second.name]  # P freed the old D's channel
        assert_pair_carries(server._channels.get(second.name), second, 3)
        old_d.close()
        new_d.close()
    finally:
        server.stop()


def test_an_open_gives_up_at_its_transfers_deadline():
    """P took the open but never joins the rendezvous (e.g. the link was cut right after): D's
    wait ends at the transfer's deadline, not the channel timeout's later."""
    server = kv_service(10.0)

    class NeverOpens:
        def submit(self, *args, **kwargs):
            return futures.Future()

        def shutdown(self, **kwargs):
            pass
    server._channels._pool = NeverOpens()
    try:
        _, stub = kv_stub(server.address, GrpcAuth(SECRET), SERVER)
        t0 = time.monotonic()
        with pytest.raises(ChannelError, match="P did not complete the rendezvous within 0.[0-9] s"):
            ChannelPool("d-test", 10.0, KEY).get(server.address, stub, t0 + 0.8)
        assert time.monotonic() - t0 < 3.0
    finally:
        server.stop()
