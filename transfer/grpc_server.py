"""P side of the gRPC transport: serves leased KV blocks to D.

Runs in P's worker process (where the KV tensors live), on a small thread pool
beside the model runner. Reads copy the blocks out (PagedKv.read) while the
lease is pinned, so the scheduler cannot free them mid-read.
"""

from __future__ import annotations

import logging
from concurrent import futures

import grpc

from pdcluster.transfer import kv_transfer_pb2 as pb
from pdcluster.transfer import kv_transfer_pb2_grpc as pb_grpc
from pdcluster.transfer.leases import LeaseError, LeaseTable
from pdcluster.transfer.paged_kv import PagedKv

log = logging.getLogger(__name__)

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
]


def layout_of(engine_id: str, kv: PagedKv) -> pb.Layout:
    return pb.Layout(engine_id=engine_id, layers=[
        pb.LayerLayout(name=i.name, group=i.group, block_shape=list(i.block_shape), dtype=str(i.dtype).removeprefix("torch."))
        for i in kv.layers.values()
    ])


def chunk_runs(num_blocks: int, block_bytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """(first, count) runs of at most chunk_bytes each (at least one block per run)."""
    per = max(1, chunk_bytes // block_bytes)
    return [(first, min(per, num_blocks - first)) for first in range(0, num_blocks, per)]


class KvTransferService(pb_grpc.KvTransferServicer):
    def __init__(self, engine_id: str, kv: PagedKv, leases: LeaseTable, chunk_bytes: int, lease_wait_s: float):
        self._engine_id = engine_id
        self._kv = kv
        self._leases = leases
        self._chunk_bytes = chunk_bytes
        self._lease_wait_s = lease_wait_s

    def GetLayout(self, request, context):
        return layout_of(self._engine_id, self._kv)

    def ReadBlocks(self, request: pb.ReadBlocksRequest, context):
        try:
            lease = self._leases.acquire(request.request_id, self._lease_wait_s)
        except LeaseError as err:
            context.abort(grpc.StatusCode.NOT_FOUND, str(err))
        try:
            for gb in request.groups:
                if gb.group >= len(lease.blocks_set) or not set(gb.block_ids) <= lease.blocks_set[gb.group]:
                    context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                  f"request {request.request_id}: group {gb.group} asks for blocks outside its lease")
                ids = list(gb.block_ids)
                for layer in (i for i in self._kv.layers.values() if i.group == gb.group):
                    for first, count in chunk_runs(len(ids), layer.block_bytes, self._chunk_bytes):
                        if not context.is_active():
                            return
                        data = self._kv.read(layer.name, ids[first:first + count])
                        yield pb.KvChunk(layer=layer.name, group=gb.group, first=first, count=count, data=data)
        finally:
            self._leases.unpin(lease)

    def Release(self, request: pb.ReleaseRequest, context):
        return pb.ReleaseReply(known=self._leases.release(request.request_id))


class KvServer:
    """A gRPC server bound to host:port, serving one engine's leased blocks."""

    def __init__(self, engine_id: str, kv: PagedKv, leases: LeaseTable, host: str, port: int, chunk_bytes: int,
                 lease_wait_s: float = 5.0):
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="pdc-kv-server"),
                                   options=GRPC_OPTIONS)
        service = KvTransferService(engine_id, kv, leases, chunk_bytes, lease_wait_s)
        pb_grpc.add_KvTransferServicer_to_server(service, self._server)
        bound = self._server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise OSError(f"KV server of {engine_id} cannot bind {host}:{port} (port in use?)")
        self.address = f"{host}:{bound}"
        self._server.start()
        log.info("KV server of %s listening on %s", engine_id, self.address)

    def stop(self) -> None:
        self._server.stop(grace=0)
